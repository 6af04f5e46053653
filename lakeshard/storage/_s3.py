"""The S3 store: ``s3://bucket/key`` (and ``s3a://``) on any S3-compatible endpoint.

Listings, Arrow datasets and Parquet writers go through s3fs (:meth:`S3Store.filesystem`: ETags
from the listing, retries from botocore's own configuration). Single requests from a thread
(:meth:`S3Store.read`, :meth:`S3Store.read_tail`, :meth:`S3Store.get`: the loader's every read,
the jobs' image reads; and the conditional writes) go through one blocking botocore client per
process instead (:func:`s3_client`, with the same settings): no event loop to hand each one to,
and a loader that never imports s3fs (design/0030).

Settings come from the standard AWS environment: credentials and region as botocore resolves
them, and the endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``. Nothing here logs
or returns credentials.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import os
import sys
import threading
import time
from typing import Any

import fsspec

from lakeshard.errors import NoConditionalWrites, StorageError
from lakeshard.storage._store import Blob, BucketStore, RequestStats, Tail

__all__ = ["S3Store", "clear_s3_clients", "s3_client", "s3_options"]

# botocore's "standard" mode retries throttling (503 SlowDown), 5xx and connection errors with
# exponential backoff, and fails at once on 403/404: permanent errors must not take minutes.
_S3_RETRIES: dict[str, Any] = {"max_attempts": 5, "mode": "standard"}
#: s3fs's own attempts around botocore's (see :meth:`S3Store.filesystem`).
_S3FS_RETRIES = 3


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


class S3Store(BucketStore):
    """Objects of an S3-compatible store (see the module doc). ETags: S3's, unquoted; ``If-Match``
    sends them quoted, as HTTP spells an entity tag."""

    scheme = "s3"
    title = "S3"

    def filesystem(self) -> Any:
        fs = fsspec.filesystem("s3", **s3_options())
        # s3fs has a retry loop of its own on top of botocore's. botocore retries a request; only
        # s3fs's loop retries a response whose body is cut off mid-read (ClientPayloadError) when
        # a file is read (fsspec files: Parquet parts, footers), so it stays on, short: a
        # permanent error (403, 404) is not retried by either. An attribute, not a constructor
        # argument (unknown arguments go to AioSession and fail).
        fs.retries = _S3FS_RETRIES
        return fs

    # -- reads --------------------------------------------------------------------------------------
    def read(
        self,
        uri: str,
        start: int = 0,
        end: int | None = None,
        *,
        if_match: str | None = None,
        stats: RequestStats | None = None,
    ) -> bytes:
        """See :meth:`Store.read`: one GET through :func:`s3_client` (no ``Range`` for the whole
        object; no HEAD first, as s3fs's ``cat_file`` sends to split a large object in parts).
        Errors are translated as s3fs translates them (``FileNotFoundError``,
        ``PermissionError``, ``OSError``; a changed object's 412 is an ``OSError``); botocore
        retries a request, and a body cut off mid-read (which botocore's retries do not cover:
        the response had come) is retried as a whole, as many times."""
        whole = start == 0 and end is None
        byte_range = None if whole else f"bytes={start}-" + ("" if end is None else str(end - 1))
        return _get(self.path(uri), byte_range, if_match, stats)[0]

    def read_tail(self, uri: str, n: int) -> Tail:
        """See :meth:`Store.read_tail`: a suffix range (``Range: bytes=-n``, no HEAD); the size
        from the answer's ``Content-Range``."""
        if n < 1:
            raise ValueError(f"n must be a positive number of bytes, got {n!r}")
        path = self.path(uri)
        data, resp = _get(path, f"bytes=-{n}", None)
        content_range = resp.get("ContentRange")
        if not content_range:  # a 200: the whole object
            return Tail(data, len(data), _etag(resp))
        total = content_range.rpartition("/")[2]
        if not total.isdigit():
            raise OSError(
                f"s3://{path}: the store answered a suffix range with Content-Range {content_range!r} (no size)"
            )
        return Tail(data, int(total), _etag(resp))

    def get(self, uri: str) -> Blob:
        """See :meth:`Store.get`; its age from the answer's ``Last-Modified`` and ``Date`` (the
        store's clock, or this machine's where the store sends no ``Date``)."""
        data, resp = _get(self.path(uri), None, None)
        headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        try:
            now = email.utils.parsedate_to_datetime(headers["date"])
        except (KeyError, TypeError, ValueError):
            now = dt.datetime.now(dt.timezone.utc)
        modified = resp.get("LastModified")
        age = (_utc(now) - _utc(modified)).total_seconds() if isinstance(modified, dt.datetime) else 0.0
        return Blob(data, _etag(resp), age)

    # -- writes -------------------------------------------------------------------------------------
    def create_if_absent(self, uri: str, data: bytes) -> str | None:
        """See :meth:`Store.create_if_absent`: a PUT with ``If-None-Match: *`` (the store answers
        412 when the key exists; one without conditional writes answers 501 NotImplemented)."""
        return self._conditional_put(uri, data, IfNoneMatch="*")

    def replace_if_unchanged(self, uri: str, data: bytes, etag: str) -> str | None:
        return self._conditional_put(uri, data, IfMatch=_quoted(etag))

    def remove_if_unchanged(self, uri: str, etag: str) -> bool:
        from botocore.exceptions import ClientError

        bucket, _, key = self.path(uri).partition("/")
        try:
            s3_client().delete_object(Bucket=bucket, Key=key, IfMatch=_quoted(etag))
        except ClientError as exc:
            if _status(exc) in (404, 412):
                return False
            raise StorageError(f"cannot delete {uri}: {exc}") from exc
        except Exception as exc:  # an endpoint that stays unreachable after botocore's retries
            raise StorageError(f"cannot delete {uri}: {type(exc).__name__}: {exc}") from exc
        return True

    def _conditional_put(self, uri: str, data: bytes, **condition: str) -> str | None:
        """One PUT of ``data`` to ``uri`` under ``condition`` (``IfNoneMatch`` or ``IfMatch``): its
        ETag, or None where the store answered that the condition does not hold (412, or 409 for
        a concurrent conditional write, as S3 may answer)."""
        from botocore.exceptions import ClientError

        bucket, _, key = self.path(uri).partition("/")
        try:
            resp = s3_client().put_object(Bucket=bucket, Key=key, Body=data, **condition)
        except ClientError as exc:
            status = _status(exc)
            if status in (409, 412) or (status == 404 and "IfMatch" in condition):
                return None
            if status in (400, 501):
                raise NoConditionalWrites(
                    f"cannot write {uri}: the store refused conditional writes (If-None-Match, If-Match): {exc}"
                ) from exc
            raise StorageError(f"cannot write {uri}: the store refused the write: {exc}") from exc
        except Exception as exc:  # an endpoint that stays unreachable after botocore's retries
            raise StorageError(f"cannot write {uri}: {type(exc).__name__}: {exc}") from exc
        return _etag(resp) or ""


def _etag(resp: dict[str, Any]) -> str | None:
    """The ETag of an answer, unquoted (a weak one, ``W/"..."``, as it is)."""
    etag = resp.get("ETag")
    if not isinstance(etag, str):
        return None
    return etag[1:-1] if len(etag) >= 2 and etag[0] == etag[-1] == '"' else etag


def _quoted(etag: str) -> str:
    """``etag`` as ``If-Match`` takes it: quoted (a weak or quoted one as it is)."""
    return etag if etag.startswith(('"', "W/")) else f'"{etag}"'


def _utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


#: The blocking S3 clients of this process (:func:`s3_client`), by process id and options.
_CLIENTS: dict[tuple[int, str], Any] = {}
_CLIENTS_LOCK = threading.Lock()
#: Connections a blocking client keeps to the store (opened as reads need them): every loader of
#: a process shares it. A loader's reads in flight, times the parts a read is split in, stay
#: within it (``loaders.options.ReadPlan``).
CLIENT_CONNECTIONS = 64


def s3_client() -> Any:
    """A blocking botocore S3 client with :meth:`S3Store.filesystem`'s settings (:func:`s3_options`:
    the endpoint, region, retries and timeouts; credentials from botocore's usual chain), one per
    process and settings; botocore clients are safe to share between threads.

    For bulk ranged reads on threads of their own (:meth:`S3Store.read`, the loader's row
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


def _get(
    path: str, byte_range: str | None, if_match: str | None, stats: RequestStats | None = None
) -> tuple[bytes, dict[str, Any]]:
    """The body and the response of one GET of ``path`` (``bucket/key``) through
    :func:`s3_client` (see :meth:`S3Store.read`), counted in ``stats``."""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError

    bucket, _, key = path.partition("/")
    extra = {"Range": byte_range} if byte_range else {}
    if if_match:
        extra["IfMatch"] = _quoted(if_match)
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
