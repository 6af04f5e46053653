"""Every path is a URI: a local path, ``file://`` or ``s3://``. This module is the one place
that turns a URI into a filesystem, through fsspec (s3fs for S3, so ETags and ranged reads
come from the listing and retries from botocore's own retry configuration). Single GETs from a
thread (:func:`s3_get`, :func:`s3_get_tail`, :func:`s3_read_range`: the loader's every read,
the jobs' image reads) go through one blocking botocore client per process instead
(:func:`s3_client`, with the same settings): no event loop to hand each one to, and a loader
that never imports s3fs (design/0030).

S3 settings come from the standard AWS environment: credentials and region as botocore
resolves them, and the endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``.
Nothing here logs or returns credentials.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import posixpath
import re
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec

from lakeshard.errors import StorageError

__all__ = [
    "CLIENT_CONNECTIONS",
    "GONE",
    "RequestCounts",
    "RequestStats",
    "bucket",
    "cat",
    "clear_s3_clients",
    "create_if_absent",
    "exists",
    "filesystem",
    "from_listing",
    "is_local",
    "is_uri",
    "join",
    "local_path",
    "modified_utc",
    "move",
    "normalize",
    "read_bytes",
    "read_json",
    "read_listed",
    "remove",
    "remove_if_unchanged",
    "remove_temporaries",
    "replace",
    "replace_if_unchanged",
    "s3_client",
    "s3_get",
    "s3_get_tail",
    "s3_options",
    "s3_path",
    "s3_read_range",
    "scheme",
    "temp_sibling",
    "write_bytes_atomic",
    "write_json_atomic",
]

log = logging.getLogger(__name__)

# botocore's "standard" mode retries throttling (503 SlowDown), 5xx and connection errors with
# exponential backoff, and fails at once on 403/404: permanent errors must not take minutes.
_S3_RETRIES: dict[str, Any] = {"max_attempts": 5, "mode": "standard"}
#: s3fs's own attempts around botocore's (see :func:`filesystem`).
_S3FS_RETRIES = 3


#: A URI scheme, as RFC 3986 spells one (``urlsplit`` would also cut ``#...`` and ``?...`` off
#: the rest, which are part of a key or file name here).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def s3_options() -> dict[str, Any]:
    """Keyword arguments for ``s3fs.S3FileSystem`` from the standard AWS environment."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs: dict[str, Any] = {}
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    return {
        "client_kwargs": client_kwargs,
        "config_kwargs": {"retries": dict(_S3_RETRIES), "connect_timeout": 10, "read_timeout": 60},
        # Listings must be fresh: a rerun after a kill lists what is there now.
        "use_listings_cache": False,
    }


def normalize(uri: str) -> str:
    """Return ``uri`` in canonical form: ``s3://bucket/key`` or ``file:///abs/path``, no
    trailing slash.

    The key or path after the scheme is taken literally, as the AWS CLI takes an ``s3://`` URI:
    ``#``, ``?``, ``%20`` and ``+`` are part of the name (``photo #1.jpg`` is a file name, not
    ``photo `` and a fragment), so a URI made by joining a listed name onto a prefix always
    names that object again.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise StorageError(f"a URI must be a non-empty string, got {uri!r}")
    match = _SCHEME.match(uri)
    scheme = match.group(1).lower() if match else ""
    rest = uri[match.end() :] if match else uri
    if scheme in ("s3", "s3a"):
        bucket, _, key = rest.removeprefix("//").partition("/")
        if not rest.startswith("//") or not bucket:
            raise StorageError(f"S3 URI {uri!r} names no bucket")
        key = key.strip("/")
        return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if scheme == "file":
        path = rest.removeprefix("//")  # file:///abs -> /abs; file:relative -> relative
    elif not scheme or len(scheme) == 1:  # plain path (or a Windows drive)
        path = uri
    else:
        raise StorageError(
            f"unsupported URI scheme {scheme!r} in {uri!r}: use a local path, file:// or s3://"
        )
    path = os.path.abspath(os.path.expanduser(path))
    return "file://" + path


# Which store a URI names is decided here, and only here: everything else asks these functions
# (tests/test_layering.py holds the rest of the code to it), so a new store is a change here.
def scheme(uri: str) -> str:
    """The store of ``uri``: ``"file"`` (a path or ``file://``) or ``"s3"`` (``s3://``, ``s3a://``).

    Raises:
        StorageError: another scheme (as :func:`normalize`)."""
    return normalize(uri).split(":", 1)[0]


def is_local(uri: str) -> bool:
    """Whether ``uri`` names a local file (a path or ``file://``), not an object in a store.
    Cheap (no normalisation): fit for every row of a listing."""
    match = _SCHEME.match(uri)
    name = match.group(1).lower() if match else ""
    return name in ("", "file") or len(name) == 1  # a plain path (or a Windows drive)


def is_uri(ref: str) -> bool:
    """Whether ``ref`` is a URI of a store this package reads, with its scheme spelt out
    (``s3://...`` or ``file://...``), not a bare path."""
    match = _SCHEME.match(ref)
    if match is None:
        return False
    return match.group(1).lower() in ("s3", "s3a", "file") and ref[match.end() :].startswith("//")


def local_path(uri: str) -> str:
    """The absolute path of a local ``uri``.

    Raises:
        StorageError: ``uri`` names an object in a store."""
    root = normalize(uri)
    if not root.startswith("file://"):
        raise StorageError(f"not a local path: {uri!r}")
    return root[len("file://") :]


def bucket(uri: str) -> str:
    """The bucket of an ``s3://`` ``uri``."""
    return s3_path(normalize(uri)).split("/", 1)[0]


def from_listing(root: str, path: str) -> str:
    """``path`` as the filesystem of ``root``'s store lists it (:func:`filesystem`: ``/abs/path``
    on a local disk, ``bucket/key`` on S3), as a URI of that store."""
    return ("file://" if is_local(root) else "s3://") + path


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``uri`` and the path within it.

    Instances are cached by fsspec, so calling this once per task in an executor is cheap.
    """
    uri = normalize(uri)
    if uri.startswith("s3://"):
        fs = fsspec.filesystem("s3", **s3_options())
        # s3fs has a retry loop of its own on top of botocore's. botocore retries a request; only
        # s3fs's loop retries a response whose body is cut off mid-read (ClientPayloadError) when
        # a file is read (fsspec files: Parquet parts, footers), so it stays on, short: a
        # permanent error (403, 404) is not retried by either. An attribute, not a constructor
        # argument (unknown arguments go to AioSession and fail).
        fs.retries = _S3FS_RETRIES
        return fs, s3_path(uri)
    return fsspec.filesystem("file"), uri[len("file://") :]


def join(uri: str, *parts: str) -> str:
    """Join path components onto a URI with ``/``."""
    uri = normalize(uri)
    return posixpath.join(uri, *parts) if parts else uri


def modified_utc(st: os.stat_result | float) -> dt.datetime:
    """A local file's modification time (its stat, or ``st_mtime``) as the manifest stores it:
    UTC, rounded to the microsecond as every listing of a local file rounds it (fsspec's
    ``info`` and the lake listing give ``st_mtime``, a float of seconds)."""
    seconds = st if isinstance(st, (int, float)) else st.st_mtime
    return dt.datetime.fromtimestamp(seconds, tz=dt.timezone.utc)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    try:
        return bool(fs.exists(path))
    except Exception as exc:  # a permission or endpoint error must name the URI
        raise StorageError(f"cannot check {uri}: {exc}") from exc


def cat(uri: str, *, end: int | None = None) -> bytes:
    """The bytes of the object or file at ``uri`` (a canonical URI, as listings give them), or
    its first ``end`` bytes; raises what the filesystem raises (``FileNotFoundError`` when it is
    gone).

    S3: one GET (:func:`s3_get`), without the HEAD s3fs's ``cat_file`` sends first to split a
    large object into parts, and with a body cut off mid-read retried (``cat_file`` raises it).
    Local files are read with ``open``: half the cost of fsspec's ``cat_file``, which counts
    when the shard job reads a lake of small images on a shared disk."""
    if uri.startswith("file://"):
        with open(uri[len("file://") :], "rb") as f:
            return f.read(end) if end is not None else f.read()
    if uri.startswith("s3://"):
        return s3_get(uri, start=0 if end is not None else None, end=end)[0]
    fs, path = filesystem(uri)
    return fs.cat_file(path, start=0 if end is not None else None, end=end)


#: The reject reason of a listed object that is gone when a job reads it.
GONE = "cannot read: object disappeared after listing"


def read_listed(uri: str, *, end: int | None = None) -> bytes | str:
    """The bytes of an object a listing found (see :func:`cat`), or :data:`GONE` if it is no
    longer there: the only read error that is a fact about the object, and a reject.

    Any other error (access denied, an archived object, an endpoint that still fails after
    botocore's retries) raises ``StorageError`` naming the URI: the cause is the platform, not
    the image, and a dataset must not silently depend on the weather. A rerun after the cause is
    fixed resumes where the job stopped."""
    try:
        return cat(uri, end=end)
    except FileNotFoundError:
        return GONE
    except Exception as exc:
        raise StorageError(f"cannot read {uri}: {type(exc).__name__}: {exc}") from exc


def s3_path(uri: str) -> str:
    """``bucket/key`` of a canonical ``s3://`` URI (:func:`normalize`), without making a
    filesystem (:func:`filesystem` imports s3fs)."""
    if not uri.startswith("s3://"):
        raise StorageError(f"not an s3:// URI: {uri!r}")
    return uri[len("s3://") :]


def s3_get(
    uri: str, *, start: int | None = None, end: int | None = None, if_match: str | None = None
) -> tuple[bytes, str | None]:
    """One GET of the S3 object at ``uri`` (bytes ``[start, end)`` if given) through
    :func:`s3_client`, blocking the calling thread, and the ETag of the very response that
    carried the bytes (unquoted). ``if_match``: the object must still have this ETag (else the
    store answers 412 and this raises: never other bytes); ``cat_file`` offers neither.

    Errors are translated as s3fs translates them (``FileNotFoundError``, ``PermissionError``,
    ``OSError``); botocore retries a request, and a body cut off mid-read (which botocore's
    retries do not cover: the response had come) is retried as a whole, as many times."""
    byte_range = None if start is None else f"bytes={start}-" + ("" if end is None else str(end - 1))
    data, resp = _get(s3_path(uri), byte_range, if_match)
    etag = resp.get("ETag")
    return data, etag.strip('"') if isinstance(etag, str) else None


def s3_get_tail(uri: str, n: int) -> tuple[bytes, int, str | None]:
    """The last ``n`` bytes of the S3 object at ``uri`` (all of it if it is shorter) in one GET
    (a suffix range, ``Range: bytes=-n``: no HEAD first), the object's size (from the answer's
    ``Content-Range``) and its ETag as the store sent it (quoted: what ``If-Match`` takes).
    Errors, retries and cut-off bodies as :func:`s3_get`."""
    if n < 1:
        raise ValueError(f"n must be a positive number of bytes, got {n!r}")
    path = s3_path(uri)
    data, resp = _get(path, f"bytes=-{n}", None)
    content_range = resp.get("ContentRange")
    if not content_range:  # a 200: the whole object
        return data, len(data), resp.get("ETag")
    total = content_range.rpartition("/")[2]
    if not total.isdigit():
        raise OSError(
            f"s3://{path}: the store answered a suffix range with Content-Range {content_range!r} (no size)"
        )
    return data, int(total), resp.get("ETag")


#: The blocking S3 clients of this process (:func:`s3_client`), by process id and options.
_CLIENTS: dict[tuple[int, str], Any] = {}
_CLIENTS_LOCK = threading.Lock()
#: Connections a blocking client keeps to the store (opened as reads need them): every loader of
#: a process shares it. A loader's reads in flight, times the parts a read is split in, stay
#: within it (``loaders.options.ReadPlan``).
CLIENT_CONNECTIONS = 64


def s3_client() -> Any:
    """A blocking botocore S3 client with :func:`filesystem`'s settings (:func:`s3_options`: the
    endpoint, region, retries and timeouts; credentials from botocore's usual chain), one per
    process and settings; botocore clients are safe to share between threads.

    For bulk ranged reads on threads of their own (:func:`s3_read_range`, the loader's row
    groups): its body arrives through ``http.client`` into one buffer, where s3fs's aiohttp
    copies every chunk twice on one event-loop thread (design/0030; the CPU per GET is in
    docs/performance.md). The S3 models s3fs has parsed already are shared, not parsed again."""
    options = s3_options()
    key = (os.getpid(), json.dumps(options, sort_keys=True))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _new_client(options)
    return client


def clear_s3_clients() -> None:
    """Forget the blocking clients :func:`s3_client` made (their connections close when they
    are collected), as a new process has none: for benchmarks timing a fresh start."""
    with _CLIENTS_LOCK:
        _CLIENTS.clear()


def _new_client(options: dict[str, Any]) -> Any:
    import botocore.session
    from botocore.config import Config

    session = botocore.session.get_session()
    if "s3fs" in sys.modules:  # a process that has s3fs working (the jobs) shares its parsed models
        s3fs_session = getattr(
            fsspec.filesystem("s3", **options), "session", None
        )  # None until s3fs's first call
        if s3fs_session is not None:
            session.register_component("data_loader", s3fs_session.get_component("data_loader"))
    config = Config(**options["config_kwargs"], max_pool_connections=CLIENT_CONNECTIONS)
    return session.create_client("s3", **options["client_kwargs"], config=config)


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """What a :class:`RequestStats` had counted at one moment; ``later - earlier`` is what was
    counted in between."""

    requests: int = 0  #: HTTP requests sent (every retry is one)
    retries: int = 0  #: of those, retries (botocore's, and GETs again of a body cut off)
    reads: int = 0  #: reads asked for (a read is one request, or more when retried)
    bytes: int = 0  #: body bytes received
    seconds: float = 0.0  #: the reads' wall time, summed
    errors: tuple[tuple[str, int], ...] = ()  #: reads that failed, by kind (sorted)

    def __sub__(self, other: RequestCounts) -> RequestCounts:
        mine, theirs = Counter(dict(self.errors)), Counter(dict(other.errors))
        return RequestCounts(
            self.requests - other.requests,
            self.retries - other.retries,
            self.reads - other.reads,
            self.bytes - other.bytes,
            self.seconds - other.seconds,
            tuple(sorted((mine - theirs).items())),
        )

    def __add__(self, other: RequestCounts) -> RequestCounts:
        return RequestCounts(
            self.requests + other.requests,
            self.retries + other.retries,
            self.reads + other.reads,
            self.bytes + other.bytes,
            self.seconds + other.seconds,
            tuple(sorted((Counter(dict(self.errors)) + Counter(dict(other.errors))).items())),
        )


@dataclass(slots=True)
class RequestStats:
    """Requests to a store, counted by the code that sends them (:func:`s3_read_range`'s
    ``stats``); safe to share between threads. ``counts()`` is what was counted so far."""

    _counts: Counter[str] = field(default_factory=Counter)
    _seconds: float = 0.0
    _errors: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self, *, requests: int, retries: int, nbytes: int, seconds: float, error: str | None = None
    ) -> None:
        with self._lock:
            self._counts.update(requests=requests, retries=retries, reads=1, bytes=nbytes)
            self._seconds += seconds
            if error is not None:
                self._errors[error] += 1

    def counts(self) -> RequestCounts:
        with self._lock:
            c = self._counts
            return RequestCounts(
                c["requests"],
                c["retries"],
                c["reads"],
                c["bytes"],
                self._seconds,
                tuple(sorted(self._errors.items())),
            )


def s3_read_range(
    path: str, start: int, end: int, *, if_match: str | None = None, stats: RequestStats | None = None
) -> bytes:
    """Bytes ``[start, end)`` of the S3 object at ``path`` (``bucket/key``) in one GET through
    :func:`s3_client`, blocking the calling thread. ``if_match`` and errors as :func:`s3_get`;
    ``stats`` counts the read (its requests, retries included, bytes, time, or its error)."""
    return _get(path, f"bytes={start}-{end - 1}", if_match, stats)[0]


def _get(
    path: str, byte_range: str | None, if_match: str | None, stats: RequestStats | None = None
) -> tuple[bytes, dict[str, Any]]:
    """The body and the response of one GET of ``path`` (``bucket/key``) through
    :func:`s3_client` (see :func:`s3_get`), counted in ``stats``."""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError

    bucket, _, key = path.partition("/")
    extra = {"Range": byte_range} if byte_range else {}
    if if_match:
        extra["IfMatch"] = if_match
    client = s3_client()
    attempts: int = _S3_RETRIES["max_attempts"]
    began, sent, retried = time.perf_counter(), 0, 0

    def count(nbytes: int, error: str | None = None) -> None:
        if stats is not None:
            stats.add(
                requests=sent,
                retries=retried,
                nbytes=nbytes,
                seconds=time.perf_counter() - began,
                error=error,
            )

    for attempt in range(attempts):
        try:
            resp = client.get_object(Bucket=bucket, Key=key, **extra)
        except ClientError as exc:
            from s3fs.errors import translate_boto_error  # s3fs's mapping, imported when needed

            botocore_retries = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
            sent, retried = sent + 1 + botocore_retries, retried + botocore_retries + (attempt > 0)
            count(0, exc.response.get("Error", {}).get("Code") or type(exc).__name__)
            raise translate_boto_error(exc) from exc
        except Exception as exc:
            count(0, type(exc).__name__)
            raise
        botocore_retries = resp.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        sent, retried = sent + 1 + botocore_retries, retried + botocore_retries + (attempt > 0)
        try:
            body = resp["Body"].read()
            count(len(body))
            return body, resp
        except (HTTPClientError, IncompleteReadError) as exc:  # cut off: the response had come
            if attempt == attempts - 1:
                count(0, "body cut off")
                raise OSError(f"s3://{path}: the response body was cut off {attempts} times: {exc}") from exc
            time.sleep(min(0.1 * 1.7**attempt, 5.0))
        finally:
            resp["Body"].close()
    raise AssertionError("unreachable")  # the loop returns or raises


def temp_sibling(path: str) -> str:
    """A unique temporary name next to ``path``, to write to and then ``os.replace`` onto it."""
    return f"{path}.tmp-{uuid.uuid4().hex}"


_TEMP_NAME = re.compile(r"\.tmp-[0-9a-f]{32}$")


def remove_temporaries(uri: str) -> list[str]:
    """Delete the temporary files (:func:`temp_sibling`) under the local folder ``uri``: what
    writers killed before their rename left behind, never a complete file. Return their paths.

    Each job calls it on its output before it writes, and the shard job again on its staging
    folder just before the commit moves that folder into the dataset. (S3 writes have no
    temporaries: an object appears whole when its upload completes.)"""
    uri = normalize(uri)
    if not uri.startswith("file://"):
        return []
    fs, path = filesystem(uri)
    try:
        found = [p for p in fs.find(path) if _TEMP_NAME.search(p)]
        for p in found:
            try:
                fs.rm_file(p)
            except FileNotFoundError:  # its writer (a killed run's task, still alive) renamed it
                pass
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise StorageError(f"cannot clean temporary files under {uri}: {exc}") from exc
    if found:
        log.info("removed %d temporary files left by killed writers under %s", len(found), uri)
    return found


def read_bytes(uri: str) -> bytes:
    """The bytes of a small file (JSON, a marker) at ``uri``, in one request."""
    uri = normalize(uri)
    try:
        return cat(uri)
    except FileNotFoundError as exc:
        raise StorageError(f"{uri} does not exist") from exc
    except Exception as exc:
        raise StorageError(f"cannot read {uri}: {exc}") from exc


def read_json(uri: str) -> Any:
    data = read_bytes(uri)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise StorageError(f"{uri} is not valid JSON: {exc}") from exc


def write_bytes_atomic(uri: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` so that readers see the old object or the new one, never a part.

    Local: write a temporary sibling, fsync (unless not ``durable``: a job's scratch file that
    a rerun writes again), then ``os.replace``. S3: one PUT, which S3 makes visible whole.
    """
    fs, path = filesystem(uri)
    try:
        if uri.startswith("s3://"):
            fs.pipe_file(path, data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = temp_sibling(path)
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        raise StorageError(f"cannot write {uri}: {exc}") from exc


def write_json_atomic(uri: str, obj: Any) -> None:
    write_bytes_atomic(uri, (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())


def create_if_absent(uri: str, data: bytes) -> str | None:
    """Create the object or file ``uri`` holding ``data`` unless something is there already, in
    one step no other writer can come between: the new object's ETag (locally the MD5 of
    ``data``, which is what S3 gives a single PUT) if this call created it, None if it was
    there. On S3 a PUT with ``If-None-Match: *`` (the store answers 412 when the key exists);
    locally ``O_CREAT | O_EXCL``.

    Raises:
        StorageError: the store refused the condition itself (an S3-compatible store without
            conditional writes answers 501 NotImplemented), or the write failed.
    """
    uri = normalize(uri)
    if uri.startswith("s3://"):
        return _conditional_put(uri, data, IfNoneMatch="*")
    path = filesystem(uri)[1]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    except OSError as exc:
        raise StorageError(f"cannot create {uri}: {exc.strerror or exc}") from exc
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def replace_if_unchanged(uri: str, data: bytes, etag: str) -> str | None:
    """Write ``data`` over the S3 object ``uri`` only if its ETag is still ``etag`` (``If-Match``):
    the new ETag, or None if the object changed or is gone since."""
    return _conditional_put(normalize(uri), data, IfMatch=f'"{etag}"')


def remove_if_unchanged(uri: str, etag: str) -> bool:
    """Delete the S3 object ``uri`` only if its ETag is still ``etag`` (``If-Match``): whether it
    was deleted (False: it changed or is gone)."""
    from botocore.exceptions import ClientError

    uri = normalize(uri)
    bucket, _, key = s3_path(uri).partition("/")
    try:
        s3_client().delete_object(Bucket=bucket, Key=key, IfMatch=f'"{etag}"')
    except ClientError as exc:
        if _status(exc) in (404, 412):
            return False
        raise StorageError(f"cannot delete {uri}: {exc}") from exc
    except Exception as exc:  # an endpoint that stays unreachable after botocore's retries
        raise StorageError(f"cannot delete {uri}: {type(exc).__name__}: {exc}") from exc
    return True


def _conditional_put(uri: str, data: bytes, **condition: str) -> str | None:
    """One PUT of ``data`` to the S3 object ``uri`` under ``condition`` (``IfNoneMatch`` or
    ``IfMatch``): its ETag (unquoted), or None where the store answered that the condition does
    not hold (412, or 409 for a concurrent conditional write, as S3 may answer)."""
    from botocore.exceptions import ClientError

    bucket, _, key = s3_path(uri).partition("/")
    try:
        resp = s3_client().put_object(Bucket=bucket, Key=key, Body=data, **condition)
    except ClientError as exc:
        status = _status(exc)
        if status in (409, 412) or (status == 404 and "IfMatch" in condition):
            return None
        what = "conditional writes (If-None-Match, If-Match)" if status in (400, 501) else "the write"
        raise StorageError(f"cannot write {uri}: the store refused {what}: {exc}") from exc
    except Exception as exc:  # an endpoint that stays unreachable after botocore's retries
        raise StorageError(f"cannot write {uri}: {type(exc).__name__}: {exc}") from exc
    return str(resp.get("ETag", "")).strip('"')


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def remove(uri: str, *, recursive: bool = False) -> None:
    """Delete ``uri`` if it exists (a folder with ``recursive=True``)."""
    fs, path = filesystem(uri)
    try:
        if fs.exists(path):
            fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass
    except Exception as exc:
        raise StorageError(f"cannot delete {uri}: {exc}") from exc


def replace(src: str, dst: str) -> None:
    """Rename ``src`` (a file or a folder) onto ``dst``: one ``os.replace``, atomic. Local
    filesystems only: S3 has no rename (a move there is a copy of every byte), so writers on S3
    write each object once where it stays (``docs/design/0012-versioned-shards.md``).

    Raises:
        StorageError: a URI that is not local, or the rename failed (naming both URIs).
    """
    src, dst = normalize(src), normalize(dst)
    if not (src.startswith("file://") and dst.startswith("file://")):
        raise StorageError(
            f"cannot move {src} to {dst}: only local files are renamed (S3 has no rename; "
            "write the object where it stays)"
        )
    dst_path = dst[len("file://") :]
    try:
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
        os.replace(src[len("file://") :], dst_path)
    except Exception as exc:
        raise StorageError(f"cannot move {src} to {dst}: {exc}") from exc


def move(src: str, dst: str) -> None:
    """Move the local folder ``src`` to ``dst`` (which must not exist): one ``os.replace``,
    atomic (see :func:`replace`)."""
    replace(src, dst)
