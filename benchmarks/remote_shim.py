"""The latency shim of :mod:`remote_store` (run by it, in its own process): an HTTP/1.1 proxy on
an ephemeral port of 127.0.0.1 in front of nginx that waits ``--latency-ms`` after each request
before forwarding it, relays each client connection over its own nginx connection, caps each
response at ``--bandwidth`` bytes/s from then on, and answers bucket-level requests
(ListObjectsV2, HEAD bucket) itself from the folder. A thread per connection; response bodies
move from nginx's socket to the client's in the kernel (``splice``), so the shim takes little of
the CPU it shares with the client it serves.

ETags: nginx's ``"<mtime hex>-<size hex>"`` has the shape of an S3 multipart upload's ETag, which
a client cannot take for the object's MD5 (the manifest job then reads the whole object to hash
it). The shim shows it as ``"<mtime hex>0<size hex>"`` (the same length, no ``-``: an object
uploaded in one PUT, as photos are) in responses and listings, and turns ``If-Match`` and
``If-None-Match`` back into nginx's form. Prints ``listening <port>`` once ready;
logs each connection and request to ``--log``; exits when its stdin closes or on SIGTERM.

```
python benchmarks/remote_shim.py ROOT --upstream NGINX_PORT --log shim.log [--latency-ms 20 --bandwidth 80MB]
```
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from xml.sax.saxutils import escape

from remote_store import _IDLE_TIMEOUT_S, parse_rate

__all__ = ["main"]

#: Response bodies are relayed (and paced) in chunks of at most this: at 80 MB/s, one each 3 ms.
_CHUNK = 256 * 1024
_MAX_HEAD = 64 * 1024
_CONTENT_LENGTH = re.compile(r"(?im)^content-length:\s*(\d+)")
#: nginx's ETag header in a response, and a client's conditional header in a request.
_NGINX_ETAG = re.compile(rb'(\r\nETag: "[0-9a-f]{8})-([0-9a-f]+")', re.IGNORECASE)
_CLIENT_ETAG = re.compile(r'(?im)^(if-(?:none-)?match:\s*"[0-9a-f]{8})0([0-9a-f]+")')


def etag(mtime: float, size: int) -> str:
    """The ETag the shim shows for a file (nginx's, without its ``-``)."""
    return f"{int(mtime):08x}0{size:x}"


class _Shim:
    def __init__(
        self, *, root: Path, bucket: str, upstream: int, latency_s: float, rate: int, log: Path
    ) -> None:
        self.root, self.bucket, self.upstream, self.latency_s, self.rate = (
            root,
            bucket,
            upstream,
            latency_s,
            rate,
        )
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
                answer = self.bucket_answer(method, target)
                time.sleep(max(0.0, arrived + self.latency_s - time.monotonic()))
                if answer is not None:
                    self.log(f"answer {method} {target} {len(answer)}")
                    client.sendall(answer)
                    continue
                if up is None:
                    up = socket.create_connection(("127.0.0.1", self.upstream))
                self.log(f"forward {method} {target}")
                up.sendall(_CLIENT_ETAG.sub(r"\1-\2", request.decode("latin-1")).encode("latin-1") + body)
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
        wake-up, goes at once: the mean rate is ``rate``, never more). False if nginx closed."""
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
        client.sendall(_NGINX_ETAG.sub(rb"\g<1>0\2", head))
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
                    f'<ETag>"{etag(st.st_mtime, st.st_size)}"</ETag><Size>{st.st_size}</Size>'
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
    while seen := sock.recv(_MAX_HEAD, socket.MSG_PEEK):
        end = seen.find(b"\r\n\r\n")
        if end >= 0:
            return _read_exactly(sock, end + 4)
        if len(seen) == _MAX_HEAD:
            raise ConnectionError(f"a message head longer than {_MAX_HEAD} bytes")
        time.sleep(0.001)  # part of a head (rare): the rest is on its way
    return None


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("the peer closed mid-message")
        data += got
    return bytes(data)


def _serve_shim(args: argparse.Namespace) -> None:
    shim = _Shim(
        root=Path(args.root),
        bucket=args.bucket,
        upstream=args.upstream,
        latency_s=args.latency_ms / 1000,
        rate=parse_rate(args.bandwidth),
        log=Path(args.log),
    )
    server = socket.create_server(("127.0.0.1", 0), backlog=1024)
    print(f"listening {server.getsockname()[1]}", flush=True)

    def accept() -> None:
        while True:
            client, _ = server.accept()
            threading.Thread(target=shim.handle, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.buffer.read()  # until the parent closes our stdin (or dies) or sends SIGTERM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the folder served as s3://<bucket>/")
    parser.add_argument("--upstream", type=int, required=True, help="nginx's port on 127.0.0.1")
    parser.add_argument("--log", required=True, help="where to log connections and requests")
    parser.add_argument("--bucket", default="bench")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth", default="80MB")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    _serve_shim(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
