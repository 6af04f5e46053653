"""A fault-injecting HTTP proxy for object store tests: forwards requests to an upstream S3
endpoint (moto on 127.0.0.1), GCS emulator or Azurite, answering a seeded fraction of them with
``500 InternalError``, ``503 SlowDown`` (``ServerBusy`` on Azure; error bodies as the store writes
them: S3's and Azure's XML, GCS's JSON), a dropped connection or a body cut off halfway (the
headers promise all of it), or denying everything with ``403 AccessDenied``
(``AuthorizationFailure`` on Azure).

It can also stall requests (hold them unanswered, as a store that stopped responding) and logs
what it forwarded, so a test counts what the store saw rather than what a client says it asked.

Clients point ``AWS_ENDPOINT_URL`` (or ``STORAGE_EMULATOR_HOST``, or the Azure connection
string's ``BlobEndpoint``) at :attr:`FaultProxy.endpoint`. The proxy only ever listens on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "Request"]

_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
    501: ("NotImplemented", "A header you provided implies functionality that is not implemented"),
}
#: Azure's codes for the same answers (its XML body names the code, and so does ``x-ms-error-code``).
_AZURE_CODES = {500: "InternalError", 503: "ServerBusy", 403: "AuthorizationFailure", 501: "NotImplemented"}
_DIALECTS = ("s3", "gcs", "azure")
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
}


class Request(NamedTuple):
    """One request as the proxy got it, and what became of it."""

    method: str
    path: str  #: with the query string
    #: the ``x-amz-copy-source`` header (a CopyObject or UploadPartCopy), or Azure's ``x-ms-copy-source``
    copy_source: str | None
    byte_range: str | None  #: the ``Range`` header
    #: ``"forwarded"`` (sent upstream), an injected fault (``403``, ``500``, ``503``, ``"drop"``),
    #: or ``"cut"`` (forwarded, its body cut off halfway)
    fate: int | str


#: The ``reason`` of a GCS JSON API error, by status (cloud.google.com/storage/docs/json_api/v1/status-codes).
_GCS_REASONS = {500: "backendError", 503: "backendError", 403: "forbidden", 501: "notImplemented"}


def _error_body(dialect: str, status: int, path: str) -> tuple[str, bytes]:
    """The content type and body of an error answer, as the store of ``dialect`` writes one."""
    code, message = _ERRORS[status]
    if dialect == "azure":
        code = _AZURE_CODES[status]
    if dialect == "gcs":
        error = {
            "code": status,
            "message": message,
            "errors": [{"reason": _GCS_REASONS[status], "message": message}],
        }
        return "application/json", json.dumps({"error": error}).encode()
    return "application/xml", (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<Resource>{path}</Resource><RequestId>hardening-proxy</RequestId></Error>"
    ).encode()


#: The transient faults ``"faults"`` mode injects: a status, a connection dropped before any
#: answer, or a body cut off halfway.
FAULT_KINDS: tuple[int | str, ...] = (500, 503, "drop", "cut")


class FaultProxy:
    """``mode`` is ``"pass"`` (forward everything), ``"faults"`` (a seeded ``rate`` of requests
    fail transiently), ``"deny"`` (every request gets 403) or ``"unconditional"`` (a conditional
    PUT gets 501, as from a store without conditional writes). ``injected`` counts what was
    injected, by kind; ``requests`` counts every request and ``log`` holds each one as a
    :class:`Request`, in the order they came; :attr:`forwarded` those that reached the store."""

    def __init__(self, upstream: str, *, seed: int = 0, dialect: str = "s3") -> None:
        """``dialect``: whose error answers to give, ``"s3"``, ``"gcs"`` or ``"azure"``."""
        if dialect not in _DIALECTS:
            raise ValueError(f"dialect must be one of {_DIALECTS}, got {dialect!r}")
        parts = urlsplit(upstream)
        self.dialect = dialect
        self._upstream = (parts.hostname, parts.port)
        self.mode = "pass"
        self.rate = 0.1
        self.kinds: list[int | str] = list(FAULT_KINDS)
        self.match = ""  # "deny" or "faults" only requests whose path contains this
        #: "faults": at most this many faults in a row on one request (method and path), so that
        #: a client with more attempts always gets through; None: no bound.
        self.streak: int | None = None
        self._in_a_row: Counter[tuple[str, str]] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.requests = 0
        #: ``None``; ``"repeats"``: hold every GET of a byte range already served once; ``"all"``:
        #: hold every request. A held request waits until :meth:`unstall` or ``hold_s``.
        self.stall: str | None = None
        self.hold_s = 30.0
        self.stalled = 0  #: requests held right now
        self.most_stalled = 0  #: the most requests held at once
        self.stalled_total = 0
        self.timed_out = 0  #: held requests let go by ``hold_s``, not by :meth:`unstall`
        self._seen: set[tuple[str, str | None]] = set()
        self.held: list[tuple[str, str, str | None]] = []  #: every request held, in order
        self._unstalled = threading.Event()
        self.log: list[Request] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                conditional = self.command == "PUT" and any(
                    h in self.headers for h in ("If-None-Match", "If-Match")
                )
                fault = proxy._choose(
                    self.command,
                    self.path,
                    self.headers.get("x-amz-copy-source") or self.headers.get("x-ms-copy-source"),
                    self.headers.get("Range"),
                    conditional=conditional,
                )
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)  # no response at all: a dropped connection
                    return
                if fault is not None and fault != "cut":
                    content_type, payload = _error_body(proxy.dialect, fault, self.path)
                    self.send_response(fault)
                    self.send_header("Content-Type", content_type)
                    if proxy.dialect == "azure":
                        self.send_header("x-ms-error-code", _AZURE_CODES[fault])
                    self.send_header("Content-Length", str(len(payload)))
                    if fault == 503:
                        self.send_header("Retry-After", "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                proxy._maybe_stall(self.command, self.path, self.headers.get("Range"))
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                head = self.command == "HEAD"  # keeps the upstream Content-Length: the object's size
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "cut" and not head and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])  # then hang up mid-body
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="hardening-fault-proxy", daemon=True
        )

    def _choose(
        self, method: str, path: str, copy_source: str | None, byte_range: str | None, *, conditional: bool
    ) -> int | str | None:
        with self._lock:
            self.requests += 1
            fault: int | str | None = None
            if self.mode == "deny" and self.match in path:
                fault = 403
            elif self.mode == "unconditional" and conditional:
                fault = 501  # a store without conditional writes (If-None-Match, If-Match)
            elif self.mode == "faults" and self.match in path:
                key = (method, path)
                if self._rng.random() < self.rate and (
                    self.streak is None or self._in_a_row[key] < self.streak
                ):
                    fault = self._rng.choice(self.kinds)
                self._in_a_row[key] = 0 if fault is None else self._in_a_row[key] + 1
            if fault is not None:
                self.injected[str(fault)] += 1
            self.log.append(
                Request(method, path, copy_source, byte_range, "forwarded" if fault is None else fault)
            )
            return fault

    @property
    def forwarded(self) -> list[Request]:
        """The requests let through to the store, in the order they came (a held one is listed
        from the moment it came; a ``"cut"`` one too: its body was cut on the way back)."""
        with self._lock:
            return [r for r in self.log if r.fate in ("forwarded", "cut")]

    def _maybe_stall(self, method: str, path: str, byte_range: str | None) -> None:
        with self._lock:
            key = (path, byte_range)
            hold = self.stall == "all" or (self.stall == "repeats" and method == "GET" and key in self._seen)
            self._seen.add(key)
            if hold:
                self.held.append((method, path, byte_range))
                self.stalled += 1
                self.stalled_total += 1
                self.most_stalled = max(self.most_stalled, self.stalled)
            unstalled = self._unstalled
        if hold:
            answered = unstalled.wait(self.hold_s)
            with self._lock:
                self.stalled -= 1
                self.timed_out += not answered

    def stall_requests(self, which: str) -> None:
        """Hold requests from now on: ``"repeats"`` or ``"all"`` (see :attr:`stall`)."""
        with self._lock:
            self.stall, self._unstalled = which, threading.Event()

    def unstall(self) -> None:
        """Answer the held requests and hold no more."""
        with self._lock:
            self.stall = None
            self._unstalled.set()

    def reset(
        self,
        *,
        mode: str,
        rate: float = 0.1,
        seed: int = 0,
        match: str = "",
        streak: int | None = None,
        kinds: tuple[int | str, ...] = FAULT_KINDS,
    ) -> None:
        """``kinds``: the faults ``"faults"`` picks from (a seeded choice each time)."""
        with self._lock:
            self.mode, self.rate, self.match, self.streak = mode, rate, match, streak
            self.kinds = list(kinds)
            self._in_a_row = Counter()
            self._rng = random.Random(seed)
            self.injected = Counter()
            self.requests = 0
            self.log = []

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
