"""The latency shim of :mod:`remote_store` (run by it, in its own process): an HTTP/1.1 proxy on
an ephemeral port of 127.0.0.1 in front of nginx that waits ``--latency-ms`` after each request
before forwarding it, relays each client connection over its own nginx connection, caps each
response at ``--bandwidth`` bytes/s from then on, and answers bucket-level requests
(ListObjectsV2, HEAD bucket) itself from the folder.

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
import asyncio
import dataclasses
import os
import re
import signal
import sys
import time
import urllib.parse
from pathlib import Path
from xml.sax.saxutils import escape

from remote_store import _IDLE_TIMEOUT_S, parse_rate

__all__ = ["main"]

_CHUNK = 64 * 1024  # responses are relayed (and paced) in chunks of at most this
_CONTENT_LENGTH = re.compile(r"(?im)^content-length:\s*(\d+)")
#: nginx's ETag header in a response, and a client's conditional header in a request.
_NGINX_ETAG = re.compile(rb'(\r\nETag: "[0-9a-f]{8})-([0-9a-f]+")', re.IGNORECASE)
_CLIENT_ETAG = re.compile(r'(?im)^(if-(?:none-)?match:\s*"[0-9a-f]{8})0([0-9a-f]+")')


def etag(mtime: float, size: int) -> str:
    """The ETag the shim shows for a file (nginx's, without its ``-``)."""
    return f"{int(mtime):08x}0{size:x}"


@dataclasses.dataclass(slots=True)
class _Pace:
    """When the relay of one connection may send its next chunk (``time.monotonic()``)."""

    due: float = 0.0


class _Shim:
    def __init__(self, *, root: Path, bucket: str, upstream: int, latency_s: float, rate: int, log: Path) -> None:
        self.root, self.bucket, self.upstream, self.latency_s, self.rate = root, bucket, upstream, latency_s, rate
        self.log = log.open("a", buffering=1)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: requests in order (HTTP/1.1 without pipelining, as boto
        sends them), each forwarded ``latency_s`` after it arrived."""
        self.log.write("connect\n")
        up_reader: asyncio.StreamReader | None = None
        up_writer: asyncio.StreamWriter | None = None
        pump: asyncio.Task[None] | None = None
        pace = _Pace()
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IDLE_TIMEOUT_S)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                    return
                arrived = time.monotonic()
                request_line, _, rest = head.decode("latin-1").partition("\r\n")
                method, target, *_ = [*request_line.split(" "), "", ""]
                length = _CONTENT_LENGTH.search(rest)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                answer = self.bucket_answer(method, target)
                await asyncio.sleep(max(0.0, arrived + self.latency_s - time.monotonic()))
                if answer is not None:
                    self.log.write(f"answer {method} {target} {len(answer)}\n")
                    writer.write(answer)
                    await writer.drain()
                    continue
                if up_writer is None:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
                    pump = asyncio.create_task(self.relay(up_reader, writer, pace))
                if pump is not None and pump.done():  # nginx closed the connection
                    return
                self.log.write(f"forward {method} {target}\n")
                pace.due = max(pace.due, time.monotonic())  # this response's schedule starts now
                up_writer.write(_CLIENT_ETAG.sub(r"\1-\2", head.decode("latin-1")).encode("latin-1") + body)
                await up_writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if pump is not None:
                pump.cancel()
            for w in (up_writer, writer):
                if w is not None:
                    w.close()

    async def relay(self, up: asyncio.StreamReader, writer: asyncio.StreamWriter, pace: _Pace) -> None:
        """nginx's responses to the client at ``rate`` bytes/s at most; closes the client when
        nginx closes. Paced by a schedule that starts when the request is forwarded
        (``pace.due``): after each chunk, wait until ``len / rate`` after the last one was due
        (a chunk behind its schedule, after a late timer, goes at once: the response's mean
        rate is ``rate`` whatever the timers do, never more)."""
        try:
            while data := await up.read(_CHUNK):
                writer.write(_NGINX_ETAG.sub(rb"\g<1>0\2", data))
                await writer.drain()
                pace.due += len(data) / self.rate
                delay = pace.due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
        except ConnectionError:
            pass
        finally:
            writer.close()

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
            return _response(501, b"<Error><Code>NotImplemented</Code><Message>read-only store: only GET/HEAD of "
                                  b"objects and ListObjectsV2</Message></Error>")  # fmt: skip
        return _response(200, self.list_v2(params).encode())

    def list_v2(self, params: dict[str, str]) -> str:
        """ListObjectsV2 of the folder: ``prefix``, ``delimiter``, ``max-keys`` (<= 1000),
        ``continuation-token``/``start-after`` (the last key of the previous page)."""
        prefix, delimiter = params.get("prefix", ""), params.get("delimiter", "")
        max_keys = min(1000, int(params.get("max-keys") or 1000))
        after = params.get("continuation-token") or params.get("start-after") or ""
        keys = sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob("*")
            if p.is_file() and p.relative_to(self.root).as_posix().startswith(prefix)
        )  # fmt: skip
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
                contents.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{modified}</LastModified>"
                                f'<ETag>"{etag(st.st_mtime, st.st_size)}"</ETag><Size>{st.st_size}</Size>'
                                "<StorageClass>STANDARD</StorageClass></Contents>")  # fmt: skip
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
    headers = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
    return headers.encode() + (b"" if head else body)


async def _serve_shim(args: argparse.Namespace) -> None:
    shim = _Shim(root=Path(args.root), bucket=args.bucket, upstream=args.upstream, latency_s=args.latency_ms / 1000,
                 rate=parse_rate(args.bandwidth), log=Path(args.log))  # fmt: skip
    server = await asyncio.start_server(shim.handle, "127.0.0.1", 0, backlog=1024, limit=1 << 20)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    # Until the parent closes our stdin (or dies) or sends SIGTERM.
    stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    async with server:
        await stdin_closed


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
    asyncio.run(_serve_shim(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
