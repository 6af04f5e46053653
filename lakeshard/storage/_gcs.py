"""The Google Cloud Storage store: ``gs://bucket/key`` (and ``gcs://``), design/0041.

Listings, Arrow datasets and Parquet writers go through gcsfs (:meth:`GCSStore.filesystem`).
Single requests from a thread (:meth:`GCSStore.read`, :meth:`GCSStore.read_tail`,
:meth:`GCSStore.get`: the loader's every read, the jobs' image reads; and the conditional writes)
go through Google's own client, ``google-cloud-storage``, one per process (:func:`gcs_client`).

An ETag here is the object's **generation** (a decimal string): what GCS's preconditions speak
(``ifGenerationMatch``: ``0`` to create, the generation to replace, delete or read those very
bytes), what a download's ``x-goog-generation`` header and a listing's ``generation`` give. It
changes with every write, even of the same bytes, and is not the MD5 of the content.

Credentials come from Google's standard chain, as ``google.auth.default()`` resolves it
(``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's application-default file, the metadata server of
GCE, GKE workload identity, Cloud Run), the project from ``GOOGLE_CLOUD_PROJECT`` or the
credentials; with ``STORAGE_EMULATOR_HOST`` set, both clients talk to that emulator, without
credentials unless ``GOOGLE_APPLICATION_CREDENTIALS`` names some. Nothing here logs or returns
credentials.
"""

from __future__ import annotations

import base64
import datetime as dt
import email.utils
import functools
import importlib
import os
import threading
import time
from typing import Any

from lakeshard.errors import StorageError
from lakeshard.storage._store import Blob, BucketStore, RequestStats, Tail, without_netrc

__all__ = ["GCSStore", "clear_gcs_clients", "gcs_client", "gcs_options"]

#: How long the client retries one request's retryable errors (429, 5xx, connections lost,
#: bodies cut off), backing off from 0.1 s to 5 s; a permanent error (403, 404, 412) is not retried.
_RETRY_TIMEOUT_S = 60.0
#: Connections the client keeps to the store (as ``CLIENT_CONNECTIONS`` of the S3 client).
CLIENT_CONNECTIONS = 64
#: Bytes the client reads from a download's body at a time (see ``_new_client``).
_BODY_CHUNK = 1 << 20
_EMULATOR = "STORAGE_EMULATOR_HOST"
_KEY_FILE = "GOOGLE_APPLICATION_CREDENTIALS"


def gcs_options() -> dict[str, Any]:
    """Keyword arguments for ``gcsfs.GCSFileSystem`` from the standard Google environment."""
    options: dict[str, Any] = {
        # Listings must be fresh: a rerun after a kill lists what is there now.
        "use_listings_cache": False,
        "project": os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT"),
    }
    if os.environ.get(_EMULATOR):  # spelt out: fsspec caches a filesystem by its arguments
        options["endpoint_url"] = os.environ[_EMULATOR]
        if not os.environ.get(_KEY_FILE):  # the emulator checks none
            options["token"] = "anon"
    return options


class GCSStore(BucketStore):
    """Objects of Google Cloud Storage (see the module doc)."""

    scheme = "gs"
    title = "GCS"

    def filesystem(self) -> Any:
        return _filesystem_class()(**gcs_options())

    def listed_etag(self, info: dict[str, Any]) -> str | None:
        generation = info.get("generation")
        return str(generation) if generation not in (None, "") else None

    def listed_md5(self, info: dict[str, Any]) -> str | None:
        """The listing's ``md5Hash`` (base64; given as hex): GCS computes it from the bytes it
        stores and refuses an upload whose stated MD5 differs. A composite object has none."""
        value = info.get("md5Hash")
        try:
            digest = base64.b64decode(value, validate=True) if isinstance(value, str) else b""
        except ValueError:  # binascii.Error: not base64
            return None
        return digest.hex() if len(digest) == 16 else None

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
        """See :meth:`Store.read`: one GET of the object's media (a ``Range`` unless whole), with
        ``ifGenerationMatch`` for ``if_match`` (a changed object's 412 is an ``OSError``). The
        client retries a request and a body cut off mid-read (from the byte it had got to); each
        retry is counted as a request."""
        if end is not None and end <= start:
            return b""
        whole = start == 0 and end is None
        return _download(
            self.path(uri),
            start=None if whole else start,
            end=None if end is None else end - 1,
            if_match=if_match,
            stats=stats,
        ).data

    def read_tail(self, uri: str, n: int) -> Tail:
        """See :meth:`Store.read_tail`: a suffix range (``Range: bytes=-n``, no metadata GET); the
        size from the answer's ``Content-Range`` (a server that ignores suffix ranges answers 200
        with the whole object, which is taken as it is)."""
        if n < 1:
            raise ValueError(f"n must be a positive number of bytes, got {n!r}")
        path = self.path(uri)
        got = _download(path, start=-n, end=None, if_match=None, stats=None)
        content_range = got.headers.get("Content-Range")
        if not content_range:  # a 200: the whole object
            return Tail(got.data[-n:], len(got.data), got.generation)
        total = content_range.rpartition("/")[2]
        if not total.isdigit():
            raise OSError(
                f"gs://{path}: the store answered a suffix range with Content-Range {content_range!r}"
            )
        return Tail(got.data, int(total), got.generation)

    def get(self, uri: str) -> Blob:
        """See :meth:`Store.get`; its age from the answer's ``Last-Modified`` and ``Date`` (the
        store's clock, or this machine's where it sends no ``Date``)."""
        got = _download(self.path(uri), start=None, end=None, if_match=None, stats=None)
        now, modified = (_http_date(got.headers.get(h)) for h in ("Date", "Last-Modified"))
        now = now or dt.datetime.now(dt.timezone.utc)
        age = (now - modified).total_seconds() if modified else 0.0
        return Blob(got.data, got.generation, age)

    # -- writes -------------------------------------------------------------------------------------
    def create_if_absent(self, uri: str, data: bytes) -> str | None:
        """See :meth:`Store.create_if_absent`: an upload with ``ifGenerationMatch=0`` (GCS answers
        412 when a live object has the name)."""
        return self._conditional_upload(uri, data, 0)

    def replace_if_unchanged(self, uri: str, data: bytes, etag: str) -> str | None:
        generation = _generation(etag)
        return None if generation is None else self._conditional_upload(uri, data, generation)

    def remove_if_unchanged(self, uri: str, etag: str) -> bool:
        from google.api_core import exceptions

        generation = _generation(etag)
        if generation is None:
            return False
        try:
            _blob(self.path(uri)).delete(if_generation_match=generation)
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return False
        except Exception as exc:
            raise StorageError(f"cannot delete {uri}: {type(exc).__name__}: {exc}") from exc
        return True

    def _conditional_upload(self, uri: str, data: bytes, generation: int) -> str | None:
        """One upload of ``data`` to ``uri`` if the live object's generation is ``generation``
        (0: there is none): the new generation, or None where GCS answered that it is not (412;
        404 for a replace of an object gone). The client retries it (a conditional upload is
        safe to send again)."""
        from google.api_core import exceptions

        blob = _blob(self.path(uri))
        try:
            blob.upload_from_string(
                data, content_type="application/octet-stream", if_generation_match=generation
            )
        except exceptions.PreconditionFailed:
            return None
        except exceptions.NotFound:
            if generation:
                return None
            raise StorageError(f"cannot write {uri}: the bucket does not exist") from None
        except Exception as exc:
            raise StorageError(f"cannot write {uri}: {type(exc).__name__}: {exc}") from exc
        return "" if blob.generation is None else str(blob.generation)  # "": written, none said


@functools.cache
def _filesystem_class() -> type:
    """gcsfs's core filesystem, its files read ahead as s3fs's are. Not ``fsspec.filesystem("gs")``:
    gcsfs's experimental subclass for zonal and hierarchical buckets, which asks a gRPC control
    plane for each bucket's layout first (and warns where it cannot), where the JSON API serves
    every bucket as it is; nor gcsfs's default "adaptive" file cache, whose prefetching tasks a
    file closed by Arrow leaves pending (asyncio logs an error for each)."""
    from gcsfs.core import GCSFileSystem

    class ReadAheadGCSFileSystem(GCSFileSystem):
        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            if kwargs.get("cache_type") is None:
                kwargs["cache_type"] = "readahead"
            return super()._open(path, mode, **kwargs)

    return ReadAheadGCSFileSystem


def _generation(etag: str) -> int | None:
    """The generation an ETag of this store names; None for one no object can have."""
    return int(etag) if etag.isdigit() and int(etag) > 0 else None


def _http_date(value: str | None) -> dt.datetime | None:
    """An HTTP date header's time, in UTC (one without a zone, ``-0000``, is UTC too)."""
    try:
        t = email.utils.parsedate_to_datetime(value) if value else None
    except (TypeError, ValueError):
        return None
    return t.replace(tzinfo=dt.timezone.utc) if t is not None and t.tzinfo is None else t


# -- the client ------------------------------------------------------------------------------------
_CLIENTS: dict[tuple[int, str, str], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def gcs_client() -> Any:
    """The ``google.cloud.storage.Client`` of this process and environment: credentials from
    Google's standard chain (none for ``STORAGE_EMULATOR_HOST`` without a key file), a pool of
    :data:`CLIENT_CONNECTIONS` connections. Its requests session is shared by threads."""
    key = (os.getpid(), os.environ.get(_EMULATOR, ""), os.environ.get(_KEY_FILE, ""))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _new_client()
    return client


def clear_gcs_clients() -> None:
    """Forget the clients :func:`gcs_client` made, as a new process has none."""
    with _CLIENTS_LOCK:
        _CLIENTS.clear()


def _new_client() -> Any:
    import google.auth
    import google.auth.transport.requests
    import requests
    from google.auth.credentials import AnonymousCredentials
    from google.auth.transport.requests import AuthorizedSession
    from google.cloud import storage as gcs
    from requests.adapters import HTTPAdapter

    project = gcs_options()["project"]
    if os.environ.get(_EMULATOR) and not os.environ.get(_KEY_FILE):
        credentials: Any = AnonymousCredentials()
    else:
        credentials, found = google.auth.default(
            scopes=["https://www.googleapis.com/auth/devstorage.full_control"]
        )
        project = project or found
    # Its token requests go through a session of their own (``auth_request``): that one too.
    tokens = google.auth.transport.requests.Request(session=without_netrc(requests.Session()))
    session = without_netrc(AuthorizedSession(credentials, auth_request=tokens))
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=CLIENT_CONNECTIONS)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    # The client copies a download's body 8 KiB at a time (``_SINGLE_GET_CHUNK_SIZE``), a
    # Python round through requests, urllib3 and http.client each: 20-25% more of the loader's
    # CPU an epoch than S3's reads of the same bytes (remote_bench). It has no option for it.
    helpers: Any = importlib.import_module("google.cloud.storage._media.requests._request_helpers")
    helpers._SINGLE_GET_CHUNK_SIZE = max(helpers._SINGLE_GET_CHUNK_SIZE, _BODY_CHUNK)
    # ``_http``: the client's documented way to hand it a session (here: a larger pool).
    return gcs.Client(project=project or "<none>", credentials=credentials, _http=session)


class _Download:
    """What one download got: its bytes, the response's headers, the object's generation."""

    __slots__ = ("data", "generation", "headers")

    def __init__(self, data: bytes, headers: Any) -> None:
        self.data, self.headers = data, headers
        self.generation: str | None = headers.get("x-goog-generation")


def _blob(path: str) -> Any:
    bucket, _, key = path.partition("/")
    return _blob_class()(key, gcs_client().bucket(bucket))


def _retryable(exc: Exception) -> bool:
    from google.cloud.storage.retry import DEFAULT_RETRY

    return bool(DEFAULT_RETRY._predicate(exc))  # the client's own test (no public name)


def _download(
    path: str, *, start: int | None, end: int | None, if_match: str | None, stats: RequestStats | None
) -> _Download:
    """One download of ``path`` (``bucket/key``), bytes ``start..end`` inclusive (``start < 0``:
    the last ``-start``), retried by the client, counted in ``stats``; errors as Python's."""
    from google.api_core import exceptions
    from google.api_core.retry import Retry

    failed: list[str] = []
    began = time.perf_counter()
    retry = Retry(
        predicate=_retryable,
        initial=0.1,
        maximum=5.0,
        multiplier=2.0,
        timeout=_RETRY_TIMEOUT_S,
        on_error=lambda exc: failed.append(type(exc).__name__),
    )

    def count(nbytes: int, error: str | None, last_counted: bool = False) -> None:
        if stats is not None:
            sent = len(failed) + (0 if last_counted else 1)
            stats.add(
                requests=sent,
                retries=sent - 1,
                nbytes=nbytes,
                seconds=time.perf_counter() - began,
                error=error,
            )

    generation = None if if_match is None else _generation(if_match)
    if if_match is not None and generation is None:
        raise OSError(f"gs://{path}: no object has the generation {if_match!r} (If-Match)")
    blob = _blob(path)
    try:
        data = blob.download_as_bytes(
            start=start,
            end=end,
            raw_download=True,
            checksum=None if start is not None else "auto",
            if_generation_match=generation,
            retry=retry,
        )
    except exceptions.RetryError as exc:
        count(0, failed[-1] if failed else "RetryError", last_counted=True)
        raise OSError(f"gs://{path}: gave up after {len(failed)} attempts: {exc}") from exc
    except exceptions.GoogleAPICallError as exc:
        count(0, type(exc).__name__)
        raise _oserror(path, exc) from exc
    except Exception as exc:
        count(0, type(exc).__name__)
        raise
    count(len(data), None)
    return _Download(data, blob.response_headers)


def _oserror(path: str, exc: Any) -> OSError:
    """The error Python raises for a file, for the client's ``exc`` about ``gs://path``."""
    code = getattr(exc, "code", 0)
    message = f"gs://{path}: {code} {getattr(exc, 'message', exc)}"
    if code == 404:
        return FileNotFoundError(2, message)
    if code in (401, 403):
        return PermissionError(13, message)
    return OSError(message)


@functools.cache
def _blob_class() -> type:
    """A client ``Blob`` that keeps its last download's response headers (the client reads the
    generation from them, not ``Content-Range``, ``Last-Modified`` or ``Date``). Made on first
    use: the client is imported by a GCS request only."""
    from google.cloud.storage import Blob as ClientBlob

    class HeadersBlob(ClientBlob):
        response_headers: Any = None  # the last download's (a case-blind mapping)

        def _extract_headers_from_download(self, response: Any) -> None:
            super()._extract_headers_from_download(response)
            self.response_headers = response.headers

    return HeadersBlob
