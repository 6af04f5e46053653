"""A remote-like, read-only S3 endpoint on 127.0.0.1 for benchmarks: a local folder served with
a bandwidth cap per connection and a latency before each response.

```python
with RemoteStore(Path("/tmp/ds-root"), latency_ms=20, bandwidth=80e6) as store:
    os.environ.update(store.environ())       # AWS_ENDPOINT_URL and dummy credentials
    loader = ShardLoader(store.uri("bench-ds"), ...)   # s3://bench/bench-ds
    before = store.traffic()
    ...
    print(store.traffic() - before)          # requests and bytes served meanwhile
```

or, by hand: ``python benchmarks/remote_store.py /tmp/ds-root --latency-ms 20 --bandwidth 80MB``
(prints the endpoint; Ctrl-C stops it).

Two processes of ours on ephemeral ports of 127.0.0.1: **nginx** (Debian's package;
``scripts/setup_bench.sh``), one process, its config in a temporary folder, serves the files;
**the latency shim** (this module run with ``--shim``) is the endpoint clients talk to, in front
of it. What each does, and why the cap is the shim's: ``benchmarks/README.md``, "Loader from
object storage" (the store).

ETags: nginx's ``"<mtime hex>-<size hex>"`` has the shape of an S3 multipart upload's ETag, which
a client cannot take for the object's MD5 (the manifest job then reads the whole object to hash
it). The shim shows it as ``"<mtime hex>0<size hex>"`` (the same length, no ``-``: an object
uploaded in one PUT, as photos are) in responses and listings, and turns ``If-Match`` and
``If-None-Match`` back into nginx's form.

The store is read-only: a client that writes gets nginx's 405.

**In front of another server** (``upstream=``, ``benchmarks/remote_bench.py --store gcs``): the
shim alone, with the same latency and rate, in front of an HTTP server already running (the GCS
emulator); no nginx, no S3 listing of its own, nothing rewritten. :meth:`RemoteStore.traffic`
then counts the bodies the shim relayed (``served`` is empty: no nginx log).

# NOTE [ Store shutdown ]
Both processes are started in their own session (process group) and stopped by
:meth:`RemoteStore.stop` (``__exit__``, and ``atexit`` for a parent that forgets): SIGTERM to
each group, a bounded wait, then SIGKILL. The shim also exits when its stdin (a pipe from the
parent) closes, so a parent killed outright leaves no shim; nginx then still needs the SIGTERM
(``stop`` is idempotent). Run as a command (``python benchmarks/remote_store.py DIR``), SIGTERM
stops it as Ctrl-C does (``atexit`` does not run on a signal): both processes stop with it.
Every wait in this module has a time limit.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import fcntl
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from xml.sax.saxutils import escape

__all__ = ["NginxMissingError", "RemoteStore", "Traffic", "find_nginx", "parse_rate"]

_SETUP = "scripts/setup_bench.sh"
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
_IDLE_TIMEOUT_S = 300.0  # a client connection silent this long is closed (nginx and the shim)
_LOG_FORMAT = '$request_method $status $body_bytes_sent $bytes_sent $request_length $uri "$http_range"'


class NginxMissingError(RuntimeError):
    """nginx is not installed."""


def find_nginx() -> str:
    """The nginx binary, or :class:`NginxMissingError` saying how to install it."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
    if found is None:
        raise NginxMissingError(
            f"nginx is not installed (the remote-like store serves files with it): run {_SETUP}"
        )
    return found


def parse_rate(text: str) -> int:
    """Bytes per second from ``"80MB"`` (decimal: 80e6), ``"25MiB"``, ``"500k"`` or a plain number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?)[bB]?(?:/s)?\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise ValueError(
            f"bandwidth must be a positive size per second such as '80MB' or '25MiB', got {text!r}"
        )
    base = 1024 if match.group(3) else 1000
    return int(float(match.group(1)) * base ** " kmg".index(match.group(2).lower() or " "))


@dataclasses.dataclass(frozen=True, slots=True)
class Traffic:
    """What the store served: ``requests`` = ``gets`` + ``heads`` + ``lists`` + ``other``
    (as the shim received them), ``connections`` opened by clients, ``body_bytes`` of file
    responses (nginx's ``$body_bytes_sent``, ranges included) and ``bytes_sent`` on the wire
    (headers too, list responses included)."""

    requests: int = 0
    gets: int = 0
    heads: int = 0
    lists: int = 0
    other: int = 0
    connections: int = 0
    body_bytes: int = 0
    bytes_sent: int = 0

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nginx_conf(tmp: Path, *, port: int, root: Path, bucket: str) -> str:
    user = "user root;" if os.geteuid() == 0 else ""  # root's workers would otherwise run as nobody
    temps = "\n".join(
        f"    {k}_temp_path {tmp / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (tmp / "errors").mkdir(exist_ok=True)
    (tmp / "errors" / "404.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchKey</Code>'
        "<Message>The specified key does not exist.</Message></Error>\n"
    )
    return f"""\
{user}
daemon off;
master_process off;
worker_processes 1;
pid {tmp / "nginx.pid"};
error_log {tmp / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
    log_format bench '{_LOG_FORMAT}';
    access_log {tmp / "access.log"} bench;
{temps}
    types {{ }}
    default_type application/octet-stream;
    sendfile on;
    sendfile_max_chunk 2m;
    keepalive_timeout {int(_IDLE_TIMEOUT_S)}s;
    keepalive_requests 1000000;
    server_tokens off;
    server {{
        listen 127.0.0.1:{port};
        error_page 404 /__errors/404.xml;
        location /__errors/ {{ internal; alias {tmp / "errors"}/; }}
        location /{bucket}/ {{
            alias {root}/;
            if (-d $request_filename) {{ return 404; }}
        }}
        location / {{ return 404; }}
    }}
}}
"""


class RemoteStore:
    """Serve the folder ``root`` as ``s3://<bucket>/`` at :attr:`endpoint`; see the module
    docstring. ``bandwidth`` is in bytes per second per connection, ``latency_ms`` before each
    response's first byte. A context manager; :meth:`start`/:meth:`stop` also work."""

    def __init__(
        self,
        root: Path,
        *,
        bucket: str = "bench",
        latency_ms: float = 20.0,
        bandwidth: int = 80_000_000,
        upstream: str | None = None,
    ) -> None:
        """``upstream``: ``http://127.0.0.1:PORT`` of a running server to put the shim in front
        of, instead of nginx serving ``root`` (see the module doc)."""
        if not Path(root).is_dir():
            raise ValueError(f"root must be an existing folder, got {str(root)!r}")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{2,62}", bucket):
            raise ValueError(f"bucket must be an S3 bucket name (3-63 of a-z 0-9 . -), got {bucket!r}")
        if not latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms!r}")
        if not isinstance(bandwidth, int) or bandwidth < 1:
            raise ValueError(f"bandwidth must be a positive number of bytes per second, got {bandwidth!r}")
        self.root, self.bucket = Path(root).resolve(), bucket
        self.latency_ms, self.bandwidth = latency_ms, bandwidth
        self.upstream = None if upstream is None else int(urllib.parse.urlsplit(upstream).port or 80)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._nginx: subprocess.Popen[bytes] | None = None
        self._shim: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> RemoteStore:
        """Start both processes; a store runs once at a time (a second start would orphan the
        first pair: stop it first)."""
        if self._tmp is not None:
            raise RuntimeError(
                f"the store at {self.endpoint or 'starting'} is already running; stop() it first"
            )
        nginx = find_nginx() if self.upstream is None else ""
        self._tmp = tempfile.TemporaryDirectory(prefix="remote-store-")
        tmp = Path(self._tmp.name)
        atexit.register(self.stop)
        try:
            port = self.upstream or self._start_nginx(nginx, tmp)
            shim = {"--upstream": port, "--bucket": self.bucket, "--latency-ms": self.latency_ms}
            shim |= {"--relay-only": 1} if self.upstream else {}
            shim |= {"--bandwidth": self.bandwidth, "--log": tmp / "shim.log"}
            self._shim = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(self.root), "--shim"]
                + [str(x) for option in shim.items() for x in option],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
            line = _read_line(self._shim, _START_TIMEOUT_S)
            if not line.startswith("listening "):
                raise RuntimeError(
                    f"the latency shim did not start (said {line!r}, exit code {self._shim.poll()})"
                )
            self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        except BaseException:
            self.stop()
            raise
        return self

    def _start_nginx(self, nginx: str, tmp: Path) -> int:
        """Start nginx on a free port (another process may take the port between our check and
        nginx's bind: then try another, three times)."""
        for _ in range(3):
            port = _free_port()
            conf = tmp / "nginx.conf"
            conf.write_text(_nginx_conf(tmp, port=port, root=self.root, bucket=self.bucket))
            (tmp / "access.log").write_bytes(b"")
            self._nginx = subprocess.Popen(
                [nginx, "-e", str(tmp / "error.log"), "-c", str(conf), "-p", str(tmp)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            deadline = time.monotonic() + _START_TIMEOUT_S
            while time.monotonic() < deadline and self._nginx.poll() is None:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return port
                time.sleep(0.02)
            err = (tmp / "error.log").read_text(errors="replace") if (tmp / "error.log").exists() else ""
            _stop_group(self._nginx)
            if "Address already in use" not in err:
                raise RuntimeError(
                    f"nginx did not start on 127.0.0.1:{port}: {err.strip()[-500:] or 'no error log'}"
                )
        raise RuntimeError("nginx found no free port in three tries")

    def stop(self) -> None:
        """Stop both processes (see NOTE [ Store shutdown ]); idempotent."""
        for proc in (self._shim, self._nginx):
            if proc is not None:
                _stop_group(proc)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        atexit.unregister(self.stop)

    def __enter__(self) -> RemoteStore:
        """Start the store (a store already started with :meth:`start` is used as it is), and
        stop it when the block ends."""
        return self if self._tmp is not None else self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        """The processes of the store (for a caller that checks none outlives it)."""
        return [p.pid for p in (self._nginx, self._shim) if p is not None]

    @property
    def shim_pids(self) -> list[int]:
        """The latency shim's process (the rest of :attr:`pids`: nginx, serving the bytes)."""
        return [self._shim.pid] if self._shim is not None else []

    # -- use ---------------------------------------------------------------------------------------
    def uri(self, key: str = "") -> str:
        """``s3://<bucket>/<key>``: ``root/<key>`` as clients of this store name it."""
        return f"s3://{self.bucket}/{key.strip('/')}".rstrip("/")

    def environ(self) -> dict[str, str]:
        """The AWS environment that points boto3/s3fs at this store (dummy credentials)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
        }

    def served(self, *, since: int = 0) -> list[str]:
        """nginx's log of the file requests served, one line each from the ``since``-th
        (``GET <status> <body bytes> <path> <range>``): which byte ranges a reader asked for.
        ``len(served())`` is where the next call's ``since`` starts."""
        if self._tmp is None:
            raise RuntimeError("the store is not running")
        if self.upstream is not None:
            return []
        lines = (Path(self._tmp.name) / "access.log").read_text().splitlines()[since:]
        return [" ".join((f[0], f[1], f[2], *f[5:])) for f in map(str.split, lines)]

    def traffic(self, *, settle_s: float = 2.0) -> Traffic:
        """Everything served since :meth:`start`. nginx logs a request when it has sent the
        last byte, a moment after the client may have it: this waits (at most ``settle_s``)
        until nginx has logged every request the shim forwarded."""
        if self._tmp is None:
            raise RuntimeError("the store is not running")
        tmp = Path(self._tmp.name)
        deadline = time.monotonic() + settle_s
        while True:
            shim = (tmp / "shim.log").read_text().splitlines()
            if self.upstream is not None:  # the bodies the shim relayed, logged as it relayed them
                nginx = [
                    ["", "", line.split()[1], line.split()[1]] for line in shim if line.startswith("body ")
                ]
            else:
                nginx = [line.split() for line in (tmp / "access.log").read_text().splitlines()]
            forwarded = sum(1 for line in shim if line.startswith("forward "))
            if len(nginx) >= forwarded or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        kinds = collections.Counter(
            " ".join(line.split()[:2]) for line in shim
        )  # "forward GET", "connect", ...
        requests = sum(n for k, n in kinds.items() if k.startswith(("forward ", "answer ")))
        known = kinds["forward GET"] + kinds["forward HEAD"] + kinds["answer GET"]
        answered = sum(int(line.split()[3]) for line in shim if line.startswith("answer "))
        return Traffic(
            requests=requests,
            gets=kinds["forward GET"],
            heads=kinds["forward HEAD"],
            lists=kinds["answer GET"],
            other=requests - known,
            connections=kinds["connect"],
            body_bytes=sum(int(f[2]) for f in nginx),
            bytes_sent=sum(int(f[3]) for f in nginx) + answered,
        )


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line ``proc`` writes on stdout, waiting at most ``timeout`` seconds."""
    stdout = proc.stdout
    if stdout is None:
        raise ValueError("proc was started without stdout=PIPE")
    ready, _, _ = select.select([stdout], [], [], timeout)
    return stdout.readline().decode(errors="replace").strip() if ready else ""


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``proc``'s process group (it leads its own session), then SIGKILL if it has
    not exited within the time limit."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
            break
        except subprocess.TimeoutExpired:
            continue
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


# -- the latency shim (its own process: ``remote_store.py ROOT --shim``) -------------------------
#: Response bodies are relayed (and paced) in chunks of at most this: at 80 MB/s, one each 3 ms.
_CHUNK = 256 * 1024
_MAX_HEAD = 64 * 1024
_CHUNKED = re.compile(r"(?im)^transfer-encoding:[^\r\n]*\bchunked\b")
_CONTENT_LENGTH = re.compile(r"(?im)^content-length:\s*(\d+)")
#: nginx's ETag header in a response, and a client's conditional header in a request.
_NGINX_ETAG = re.compile(rb'(\r\nETag: "[0-9a-f]{8})-([0-9a-f]+")', re.IGNORECASE)
_CLIENT_ETAG = re.compile(r'(?im)^(if-(?:none-)?match:\s*"[0-9a-f]{8})0([0-9a-f]+")')


def _etag(mtime: float, size: int) -> str:
    """The ETag the shim shows for a file (nginx's, without its ``-``)."""
    return f"{int(mtime):08x}0{size:x}"


class _Shim:
    """The latency shim's state: the folder and bucket it lists, nginx's ``upstream`` port, the
    latency and the rate per connection, and its log (one line per connection and request)."""

    def __init__(
        self,
        *,
        root: Path,
        bucket: str,
        upstream: int,
        latency_s: float,
        rate: int,
        log: Path,
        relay_only: bool,
    ) -> None:
        self.root, self.bucket, self.upstream = root, bucket, upstream
        self.relay_only = relay_only  #: in front of another server: no listing, nothing rewritten
        self.latency_s, self.rate = latency_s, rate
        self._log = log.open("a", buffering=1)
        self._log_lock = threading.Lock()

    def log(self, line: str) -> None:
        with self._log_lock:
            self._log.write(line + "\n")

    def handle(self, client: socket.socket) -> None:
        """One client connection, on a thread of its own: requests in order (HTTP/1.1 without
        pipelining, as boto sends them), each forwarded ``latency_s`` after it arrived, its
        response relayed before the next request is read."""
        self.log("connect")
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a head, then its body: no Nagle wait
        up: socket.socket | None = None
        pipe = os.pipe()
        try:
            fcntl.fcntl(pipe[1], fcntl.F_SETPIPE_SZ, _CHUNK)  # a chunk at a time
            while (request := _read_head(client, idle_s=_IDLE_TIMEOUT_S)) is not None:
                arrived = time.monotonic()
                request_line, _, rest = request.decode("latin-1").partition("\r\n")
                method, target, *_ = [*request_line.split(" "), "", ""]
                length = _CONTENT_LENGTH.search(rest)
                body = _read_exactly(client, int(length.group(1))) if length else b""
                answer = None if self.relay_only else self.bucket_answer(method, target)
                time.sleep(max(0.0, arrived + self.latency_s - time.monotonic()))
                if answer is not None:
                    self.log(f"answer {method} {target} {len(answer)}")
                    client.sendall(answer)
                    continue
                if up is None:
                    up = socket.create_connection(("127.0.0.1", self.upstream))
                self.log(f"forward {method} {target}")
                head = (
                    request
                    if self.relay_only
                    else _CLIENT_ETAG.sub(r"\1-\2", request.decode("latin-1")).encode("latin-1")
                )
                up.sendall(head + body)
                if not self.relay(up, client, pipe, method):
                    return  # nginx closed the connection
        except OSError:  # a connection reset, a client gone
            return
        finally:
            for fd in pipe:
                os.close(fd)
            for sock in (up, client):
                if sock is not None:
                    sock.close()

    def relay(self, up: socket.socket, client: socket.socket, pipe: tuple[int, int], method: str) -> bool:
        """nginx's response to ``method`` to the client at ``rate`` bytes/s at most: its head
        rewritten (the ETag), its body (``Content-Length`` bytes; none for a HEAD's or a 304's)
        moved from socket to socket in the kernel (``splice`` through ``pipe``), in chunks of
        up to :data:`_CHUNK`. Paced by a schedule that starts now: each chunk goes once the
        bytes up to its end are due at ``rate`` (a chunk behind its schedule, after a late
        wake-up, goes at once: the mean rate is ``rate``, never more). A chunked body (no
        length) goes up to its last chunk (:func:`_relay_chunked`), paced alike. False if nginx
        closed."""
        due = time.monotonic()

        def wait(n: int) -> None:
            nonlocal due
            due += n / self.rate
            time.sleep(max(0.0, due - time.monotonic()))

        head = _read_head(up, idle_s=None)
        if head is None:
            return False
        length = _CONTENT_LENGTH.search(head.decode("latin-1"))
        left = (
            0
            if method == "HEAD" or head[9:12] in (b"204", b"304")
            else int(length.group(1))
            if length
            else -1
        )
        wait(len(head))
        client.sendall(head if self.relay_only else _NGINX_ETAG.sub(rb"\g<1>0\2", head))
        if left < 0 and _CHUNKED.search(head.decode("latin-1")):
            # Azurite's listings: the body ends at its last chunk, not when the server closes
            # (it keeps the connection open for its next request: waiting for the close would
            # stall each listing for the server's keep-alive time).
            body = _relay_chunked(up, client, wait)
            if self.relay_only:
                self.log(f"body {body}")
            return True
        if self.relay_only:
            self.log(f"body {max(left, 0)}")
        while left:  # -1: no length, until nginx closes
            n = os.splice(up.fileno(), pipe[1], _CHUNK if left < 0 else min(left, _CHUNK))
            if n == 0:
                return False
            wait(n)
            moved = 0
            while moved < n:
                moved += os.splice(pipe[0], client.fileno(), n - moved)
            left = left if left < 0 else left - n
        return True

    def bucket_answer(self, method: str, target: str) -> bytes | None:
        """The response to a bucket-level request (``/<bucket>`` or ``/<bucket>/`` with a
        query), or None for an object request (nginx serves it)."""
        path, _, query = target.partition("?")
        if urllib.parse.unquote(path).rstrip("/") != f"/{self.bucket}":
            return None
        params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
        if method == "HEAD":
            return _response(200, b"", head=True)
        if method != "GET" or params.get("list-type") != "2":
            return _response(
                501,
                b"<Error><Code>NotImplemented</Code><Message>read-only store: only GET/HEAD of "
                b"objects and ListObjectsV2</Message></Error>",
            )
        return _response(200, self.list_v2(params).encode())

    def list_v2(self, params: dict[str, str]) -> str:
        """ListObjectsV2 of the folder: ``prefix``, ``delimiter``, ``max-keys`` (<= 1000),
        ``continuation-token``/``start-after`` (the last key of the previous page)."""
        prefix, delimiter = params.get("prefix", ""), params.get("delimiter", "")
        max_keys = min(1000, int(params.get("max-keys") or 1000))
        after = params.get("continuation-token") or params.get("start-after") or ""
        keys = sorted(
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.is_file() and p.relative_to(self.root).as_posix().startswith(prefix)
        )
        contents: list[str] = []
        prefixes: list[str] = []
        last = ""
        for key in keys:
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            name = key[: cut + len(delimiter)] if cut >= 0 else key
            if name <= after or (prefixes and prefixes[-1] == name):
                continue
            if len(contents) + len(prefixes) == max_keys:
                break
            if cut >= 0:
                prefixes.append(name)
            else:
                st = (self.root / key).stat()
                modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
                contents.append(
                    f"<Contents><Key>{escape(key)}</Key><LastModified>{modified}</LastModified>"
                    f'<ETag>"{_etag(st.st_mtime, st.st_size)}"</ETag><Size>{st.st_size}</Size>'
                    "<StorageClass>STANDARD</StorageClass></Contents>"
                )
            last = name
        truncated = any(k > last and not k.startswith(last) for k in keys) if last else False
        token = f"<NextContinuationToken>{escape(last)}</NextContinuationToken>" if truncated else ""
        return (
            '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(self.bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(contents) + len(prefixes)}"
            f"</KeyCount><MaxKeys>{max_keys}</MaxKeys><Delimiter>{escape(delimiter)}</Delimiter>"
            f"<IsTruncated>{str(truncated).lower()}</IsTruncated>{token}{''.join(contents)}"
            + "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes)
            + "</ListBucketResult>"
        )


def _response(status: int, body: bytes, *, head: bool = False) -> bytes:
    reason = {200: "OK", 501: "Not Implemented"}[status]
    headers = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return headers.encode() + (b"" if head else body)


def _read_head(sock: socket.socket, *, idle_s: float | None) -> bytes | None:
    """The next message head on ``sock`` (up to and with its blank line), read without taking
    a byte of what follows it; None if the peer closed first (or was silent ``idle_s``)."""
    if idle_s is not None and not select.select([sock], [], [], idle_s)[0]:
        return None
    return _read_through(sock, b"\r\n\r\n")


def _read_through(sock: socket.socket, end: bytes) -> bytes | None:
    """The bytes on ``sock`` up to and with the first ``end``, read without taking a byte past
    it; None if the peer closed first."""
    while seen := sock.recv(_MAX_HEAD, socket.MSG_PEEK):
        at = seen.find(end)
        if at >= 0:
            return _read_exactly(sock, at + len(end))
        if len(seen) == _MAX_HEAD:
            raise ConnectionError(f"no {end!r} in the next {_MAX_HEAD} bytes")
        time.sleep(0.001)  # a part (rare): the rest is on its way
    return None


def _relay_chunked(up: socket.socket, client: socket.socket, wait: Callable[[int], None]) -> int:
    """A chunked body (``Transfer-Encoding: chunked``) from ``up`` to ``client`` as it comes, each
    piece after ``wait`` (the pacing) for its size, up to and with its last chunk and trailers;
    returns the bytes of data it held (the chunks' sizes summed)."""
    data = 0
    while True:
        line = _read_crlf(up)
        wait(len(line))
        client.sendall(line)
        size = int(line.split(b";")[0], 16)  # the size, before any chunk extension
        if size == 0:
            while (trailer := _read_crlf(up)) != b"\r\n":  # trailers, then the blank line
                client.sendall(trailer)
            client.sendall(trailer)
            return data
        data += size
        left = size + 2  # the chunk's data and its CRLF
        while left:
            got = up.recv(min(left, _CHUNK))
            if not got:
                raise ConnectionError("the peer closed mid-chunk")
            wait(len(got))
            client.sendall(got)
            left -= len(got)


def _read_crlf(sock: socket.socket) -> bytes:
    """The next CRLF-ended line on ``sock`` (with its CRLF)."""
    line = _read_through(sock, b"\r\n")
    if line is None:
        raise ConnectionError("the peer closed mid-message")
    return line


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("the peer closed mid-message")
        data += got
    return bytes(data)


def _serve_shim(args: argparse.Namespace) -> None:
    """Run as the latency shim (``--shim``): until stdin closes or SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    shim = _Shim(
        root=Path(args.root),
        bucket=args.bucket,
        upstream=args.upstream,
        latency_s=args.latency_ms / 1000,
        rate=parse_rate(args.bandwidth),
        log=Path(args.log),
        relay_only=bool(args.relay_only),
    )
    server = socket.create_server(("127.0.0.1", 0), backlog=1024)
    print(f"listening {server.getsockname()[1]}", flush=True)

    def accept() -> None:
        while True:
            client, _ = server.accept()
            threading.Thread(target=shim.handle, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.buffer.read()  # until the parent closes our stdin (or dies) or sends SIGTERM


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the folder to serve as s3://<bucket>/")
    parser.add_argument("--bucket", default="bench")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="before each response's first byte")
    parser.add_argument("--bandwidth", default="80MB", help="per connection, per second (80MB = 80e6 bytes)")
    shim = parser.add_argument_group("the latency shim alone (what RemoteStore runs)")
    shim.add_argument("--shim", action="store_true", help="serve as the shim in front of nginx at --upstream")
    shim.add_argument("--upstream", type=int, help="nginx's port on 127.0.0.1")
    shim.add_argument("--log", help="where to log connections and requests")
    shim.add_argument(
        "--relay-only", type=int, default=0, help="1: in front of another server (no listing, no rewrite)"
    )
    args = parser.parse_args(argv)
    if args.shim:
        if args.upstream is None or args.log is None:
            parser.error("--shim needs --upstream and --log")
        _serve_shim(args)
        return 0
    try:
        store = RemoteStore(
            Path(args.root),
            bucket=args.bucket,
            latency_ms=args.latency_ms,
            bandwidth=parse_rate(args.bandwidth),
        )
    except ValueError as exc:
        parser.error(str(exc))
    # SIGTERM (kill, a job scheduler) skips atexit: stop as Ctrl-C does, so nginx stops with us.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with store:
            print(" ".join(f"{k}={v}" for k, v in store.environ().items()))
            print(f"serving {store.root} as {store.uri()} (Ctrl-C or SIGTERM stops)", flush=True)
            threading.Event().wait()
    except NginxMissingError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
