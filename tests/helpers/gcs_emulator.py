"""gcp-storage-emulator (PyPI) as the tests run it: in memory on 127.0.0.1, with what it lacks of
the GCS JSON API added here, test-side, as Google documents it (design/0041):

* **Generation preconditions** (https://cloud.google.com/storage/docs/request-preconditions):
  ``ifGenerationMatch`` and ``ifGenerationNotMatch`` on uploads, downloads, metadata reads and
  deletes. A condition that does not hold is answered ``412 conditionNotMet``;
  ``ifGenerationMatch=0`` means "no live object of that name". Real GCS enforces them; the
  emulator (2026.7.19) ignores them, so without this a lock test would pass against anything.
  One lock is held around every handler, so a check and the write it guards are one step.
* **What a download answers** (https://cloud.google.com/storage/docs/json_api/v1/objects/get):
  ``x-goog-generation``, ``x-goog-metageneration`` and ``Last-Modified`` headers, and suffix
  ranges (``Range: bytes=-N``, RFC 9110 14.1.2), which the emulator ignores.
* **Threads**: a thread per connection (the emulator's server takes one connection at a time,
  with a listen backlog of 5), the handlers still one at a time.
* **Listing pages** (https://cloud.google.com/storage/docs/json_api/v1/objects/list):
  ``startOffset`` (inclusive), ``endOffset`` (exclusive), ``maxResults`` (items and prefixes
  together, at most 1,000) and ``pageToken``/``nextPageToken``, which the emulator ignores (it
  answers every entry in one page): what the manifest job's balanced listing seeks with.
* **Basic credentials refused**: a request whose ``Authorization`` is ``Basic ...`` is answered
  ``401``, as GCS answers it (it takes OAuth bearer tokens, and HMAC signatures on its XML API;
  https://cloud.google.com/storage/docs/authentication); the emulator takes any.
* **A request count**: ``GET /_lakeshard/requests`` gives the media downloads (``GET`` of an
  object's bytes) served so far, by bucket: the store's own count, compared with the loader's.

Run ``python -m tests.helpers.gcs_emulator``: it prints the port it listens on, then serves
until stdin closes or it is terminated. :func:`start_emulator` does that from a fixture.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from email.utils import format_datetime
from functools import partial
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["Emulator", "start_emulator"]

_LOCK = threading.Lock()
_DOWNLOADS: Counter[str] = Counter()
_READS: list[tuple[str, str, str | None]] = []  # (bucket, object, its Range header) of each download
_COUNTS_PATH = "/_lakeshard/requests"
_READS_PATH = "/_lakeshard/reads"


@dataclass
class Emulator:
    """A running emulator subprocess: its endpoint (``http://127.0.0.1:PORT``)."""

    endpoint: str
    process: subprocess.Popen[str]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def downloads(self) -> dict[str, int]:
        """Media downloads served so far, by bucket."""
        import urllib.request

        with urllib.request.urlopen(self.endpoint + _COUNTS_PATH, timeout=30) as resp:
            return dict(json.loads(resp.read()))

    def reads(self, bucket: str) -> list[tuple[str, str | None]]:
        """The media downloads of ``bucket`` served so far, in order: the object and the
        ``Range`` header asked (None: the whole object)."""
        import urllib.request

        with urllib.request.urlopen(self.endpoint + _READS_PATH, timeout=30) as resp:
            return [(name, asked) for b, name, asked in json.loads(resp.read()) if b == bucket]


def start_emulator(timeout_s: float = 120.0) -> Emulator:
    """Start the emulator in a subprocess on a free port of 127.0.0.1 and wait until it listens."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.gcs_emulator"],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # a client that hangs up mid-answer: a traceback each
        text=True,
    )
    assert proc.stdout is not None
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout_s)
    if not line or not line[0].strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the GCS emulator did not start within {timeout_s:g} s: {line!r}")
    return Emulator(f"http://127.0.0.1:{int(line[0])}", proc)


# -- inside the emulator's process -----------------------------------------------------------------
def _precondition_failed(response: Any) -> None:
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json(
        {
            "error": {
                "code": 412,
                "message": "At least one of the pre-conditions you specified did not hold.",
                "errors": [{"reason": "conditionNotMet", "domain": "global"}],
            }
        }
    )


def _object_name(request: Any) -> str | None:
    """The object a request names: in its path, or for an upload in ``name=`` or its metadata."""
    params = request.params or {}
    if params.get("object_id"):
        return str(params["object_id"])
    if "name" in request.query:
        return str(request.query["name"][0])
    data = request.data
    if isinstance(data, dict):
        meta = data.get("meta") if "meta" in data else data
        if isinstance(meta, dict) and meta.get("name"):
            return str(meta["name"])
    return None


def _holds(request: Any, storage: Any, upload: bool) -> bool:
    """Whether the request's generation preconditions hold (true where it has none). A missing
    object fails ``ifGenerationMatch=N`` (N != 0) of an upload; a read or delete of a missing
    object is left to the handler's 404, as GCS answers."""
    match, not_match = (
        request.query.get(k, [None])[0] for k in ("ifGenerationMatch", "ifGenerationNotMatch")
    )
    if match is None and not_match is None:
        return True
    name = _object_name(request)
    try:
        current: str | None = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
    except Exception:  # the emulator's NotFound
        current = None
    if current is None:
        return (upload and match == "0") or not upload
    if match is not None and match != current:
        return False
    return not_match is None or not_match != current


def _suffix_range(request: Any, response: Any, storage: Any) -> bool:
    """Answer ``Range: bytes=-N`` (the last N bytes) as GCS does, 206 with ``Content-Range``;
    False for any other request (and for a missing object: the handler answers 404)."""
    value = (request.get_header("range") or "").strip()
    if not value.startswith("bytes=-"):
        return False
    bucket, name = request.params["bucket_name"], request.params["object_id"]
    try:
        data, obj = storage.get_file(bucket, name), storage.get_file_obj(bucket, name)
    except Exception:  # the emulator's NotFound
        return False
    start = max(0, len(data) - int(value[len("bytes=-") :]))
    response.status = HTTPStatus.PARTIAL_CONTENT
    response["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
    response.write_file(data[start:], content_type=obj.get("contentType"))
    return True


def _download_headers(request: Any, response: Any, storage: Any) -> None:
    if response.status not in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
        return
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])
    updated = datetime.fromisoformat(obj["updated"].replace("Z", "+00:00"))
    response["Last-Modified"] = format_datetime(updated, usegmt=True)


def _basic_refused(request: Any, response: Any) -> bool:
    """Answer a request with Basic credentials 401, as GCS does; False for any other."""
    if not (request.get_header("authorization") or "").lower().startswith("basic "):
        return False
    response.status = HTTPStatus.UNAUTHORIZED
    response.json(
        {
            "error": {
                "code": 401,
                "message": "Invalid Credentials",
                "errors": [{"reason": "authError", "domain": "global", "locationType": "header"}],
            }
        }
    )
    return True


def _extended(handler: Callable[..., Any], *, upload: bool, download: bool) -> Callable[..., Any]:
    def run(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        media = download or request.query.get("alt", [""])[0] == "media"
        if _basic_refused(request, response):
            return None
        with _LOCK:
            if not _holds(request, storage, upload):
                return _precondition_failed(response)
            if media:
                _DOWNLOADS[request.params["bucket_name"]] += 1
                _READS.append(
                    (request.params["bucket_name"], request.params["object_id"], request.get_header("range"))
                )
            if not (media and _suffix_range(request, response, storage)):
                handler(request, response, storage, *args, **kwargs)
            if media:
                _download_headers(request, response, storage)

    return run


def _paged(handler: Callable[..., Any]) -> Callable[..., Any]:
    """The objects list ``handler`` with the listing pages of the module doc: its answer's
    entries (items and prefixes, in name order) in ``[startOffset, endOffset)``, after the one
    ``pageToken`` names, ``maxResults`` of them, ``nextPageToken`` naming the last where more
    are left."""

    def run(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        answered: list[dict[str, Any]] = []
        response.json = answered.append  # the emulator's answer (every entry), kept to be paged
        try:
            handler(request, response, storage, *args, **kwargs)
        finally:
            del response.json
        if response.status != HTTPStatus.OK or not answered:
            return response.json(*answered) if answered else None
        body, query = answered[0], {k: v[0] for k, v in request.query.items() if v}
        entries = sorted(
            [(item["name"], item) for item in body.get("items", [])]
            + [(prefix, prefix) for prefix in body.get("prefixes", [])],
            key=lambda entry: entry[0],
        )
        start, end = query.get("startOffset"), query.get("endOffset")
        after = base64.urlsafe_b64decode(query["pageToken"]).decode() if "pageToken" in query else None
        entries = [
            e
            for e in entries
            if (start is None or e[0] >= start)
            and (end is None or e[0] < end)
            and (after is None or e[0] > after)
        ]
        size = min(int(query.get("maxResults", 1000)), 1000)
        page: dict[str, Any] = {
            "kind": "storage#objects",
            "items": [e[1] for e in entries[:size] if isinstance(e[1], dict)],
            "prefixes": [e[1] for e in entries[:size] if isinstance(e[1], str)],
        }
        if len(entries) > size:
            page["nextPageToken"] = base64.urlsafe_b64encode(entries[size - 1][0].encode()).decode()
        response.json(page)

    return run


def _counts(request: Any, response: Any, storage: Any) -> None:
    with _LOCK:
        response.json(dict(_DOWNLOADS))


def _reads(request: Any, response: Any, storage: Any) -> None:
    with _LOCK:
        response.json(list(_READS))


def _install() -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    def extend(handlers: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
        return {
            method: _extended(
                _paged(fn) if fn is objects.ls else fn,
                upload=fn in (objects.insert, objects.xml_upload),
                download=fn is objects.download,
            )
            for method, fn in handlers.items()
        }

    extended = tuple((regex, extend(handlers)) for regex, handlers in server.HANDLERS)
    server.HANDLERS = (
        (rf"^{_COUNTS_PATH}$", {"GET": _counts}),
        (rf"^{_READS_PATH}$", {"GET": _reads}),
        *extended,
    )
    objects.insert = _extended(objects.insert, upload=True, download=False)  # the router's fallback


def main() -> None:
    import logging

    from gcp_storage_emulator.server import RequestHandler
    from gcp_storage_emulator.storage import Storage

    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
    _install()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(RequestHandler, Storage(use_memory_fs=True)))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(httpd.server_port, flush=True)
    sys.stdin.read()  # until the fixture closes stdin (or terminates this process)
    httpd.shutdown()


if __name__ == "__main__":
    main()
