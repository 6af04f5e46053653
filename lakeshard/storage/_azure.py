"""The Azure Blob Storage store: ``az://container/blob`` (and ``abfs://``/``abfss://``, with or
without ``@<account>.dfs.core.windows.net``), design/0042.

Listings, Arrow datasets and Parquet writers go through adlfs (:meth:`AzureStore.filesystem`).
Single requests from a thread (:meth:`AzureStore.read`, :meth:`AzureStore.read_tail`,
:meth:`AzureStore.get`, the writes, the conditional writes of the dataset lock) go through one
blocking ``azure-storage-blob`` client per process and settings (:func:`azure_client`), as
:mod:`lakeshard.storage._s3` does with botocore.

Credentials, from the first of these that is set (:func:`azure_settings`): the connection string
``AZURE_STORAGE_CONNECTION_STRING`` (account, key or SAS, endpoint); else the account
``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY``, or with
``AZURE_STORAGE_SAS_TOKEN``, or with azure-identity's ``DefaultAzureCredential`` (a service
principal's ``AZURE_CLIENT_ID``/``AZURE_TENANT_ID``/``AZURE_CLIENT_SECRET``, workload identity,
a managed identity, the Azure CLI's login). adlfs reads the same variables in the same order.
Nothing here logs or returns credentials.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lakeshard.errors import StorageError
from lakeshard.storage._azure_sdk import (
    AzureSettings,
    error_code,
    filesystem_class,
    retry_policy,
    service_client,
    translated,
)
from lakeshard.storage._store import Blob, BucketStore, RequestStats, Tail, split_scheme, without_netrc

__all__ = ["AzureSettings", "AzureStore", "azure_client", "azure_settings", "clear_azure_clients"]

#: The host of an ``abfs://container@<account>.dfs.core.windows.net/`` URI, after the account.
_DFS_HOST = ".dfs.core.windows.net"
#: A read up to this size is one GET (the SDK splits a larger whole-object read in chunks).
_SINGLE_GET = 1 << 30
_MISSING_SDK = "reading az:// needs the Azure extra: pip install 'lakeshard[azure]'"


def azure_settings() -> AzureSettings:
    """The settings of the environment (see the module doc).

    Raises:
        StorageError: none of the variables is set (naming them, never their values)."""
    env = os.environ.get
    if env("AZURE_STORAGE_CONNECTION_STRING"):
        return AzureSettings(connection_string=env("AZURE_STORAGE_CONNECTION_STRING"))
    account = env("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise StorageError(
            "no Azure credentials: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
            "(with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, or an identity "
            "DefaultAzureCredential finds)"
        )
    if env("AZURE_STORAGE_ACCOUNT_KEY"):
        return AzureSettings(account_name=account, account_key=env("AZURE_STORAGE_ACCOUNT_KEY"))
    return AzureSettings(account_name=account, sas_token=env("AZURE_STORAGE_SAS_TOKEN") or None)


class AzureStore(BucketStore):
    """Blobs of an Azure storage account (see the module doc): a container is a bucket. ETags:
    Azure's, unquoted (``0x8DC...``: not an MD5 of the bytes); conditions send them quoted."""

    scheme = "az"
    title = "Azure"
    bucket_word = "container"

    def normalize(self, uri: str) -> str:
        """``az://container/blob``, the blob name taken literally; an ``abfs[s]://`` URI names
        the same blob (``container@account.dfs.core.windows.net`` must be this account's)."""
        name, rest = split_scheme(uri)
        netloc, slash, blob = rest.removeprefix("//").partition("/")
        if "@" in netloc and name != "az" and rest.startswith("//"):
            container = self._container_of(netloc, uri)
            if not container:
                raise StorageError(f"Azure URI {uri!r} names no container")
            uri = f"az://{container}{slash}{blob}"
        return super().normalize(uri)

    @staticmethod
    def _container_of(netloc: str, uri: str) -> str:
        """The container of ``container@<account>.dfs.core.windows.net``, refused unless the
        account is the one the settings name."""
        container, _, host = netloc.partition("@")
        account = host.removesuffix(_DFS_HOST)
        try:
            ours = _account_of(azure_settings())
        except StorageError:  # no credentials yet: the first request will say so
            ours = None
        if not host.endswith(_DFS_HOST) or (ours is not None and account != ours):
            raise StorageError(
                f"Azure URI {uri!r} names the account host {host!r}, but the credentials are for "
                f"{ours or 'an account set by the connection string'}: write az://{container}/..."
            )
        return container

    def filesystem(self) -> Any:
        _require_sdk()
        return filesystem_class()(**azure_settings().fs_options())

    def listed_md5(self, info: dict[str, Any]) -> str | None:
        """The blob's ``Content-MD5`` property as the listing gives it (adlfs's
        ``content_settings``). Azure computes it for a blob written in one Put Blob (what the SDK
        does up to 64 MiB); a blob committed from blocks has it only if its writer stated it
        (``azcopy --put-md5``, the SDK's ``content_settings``), unchecked by Azure, and none
        otherwise (such a blob is read whole to hash it)."""
        settings = info.get("content_settings") or {}
        digest = settings.get("content_md5")  # a dict or the SDK's ContentSettings (a mapping too)
        return bytes(digest).hex() if isinstance(digest, (bytes, bytearray)) and len(digest) == 16 else None

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
        """See :meth:`Store.read`: one GET (``x-ms-range`` for a range), retried by the SDK's
        retry policy, and a body cut off mid-read by its downloader; every request sent counted."""
        length = None if end is None else max(end - start, 0)
        if length == 0:
            return b""
        offset = start if start or length is not None else None
        return _download(self.path(uri), offset, length, if_match, stats)[0]

    def read_tail(self, uri: str, n: int) -> Tail:
        """See :meth:`Store.read_tail`. Two requests, not one: Azure takes no suffix range
        (``bytes=-n``), so the size comes first (a HEAD), then the range, read only if the ETag
        is still the HEAD's."""
        if n < 1:
            raise ValueError(f"n must be a positive number of bytes, got {n!r}")
        path = self.path(uri)
        props = _call(path, lambda blob: blob.get_blob_properties())
        size, etag = int(props.size), _unquoted(props.etag)
        start = max(size - n, 0)
        data = _download(path, start, size - start, etag, None)[0] if size else b""
        return Tail(data, size, etag)

    def get(self, uri: str) -> Blob:
        """See :meth:`Store.get`; its age from the answer's ``Last-Modified`` and ``Date``."""
        data, props, date = _download(self.path(uri), None, None, None, None)
        now = _utc(date or dt.datetime.now(dt.timezone.utc))
        modified = props.last_modified
        age = (now - _utc(modified)).total_seconds() if isinstance(modified, dt.datetime) else 0.0
        return Blob(data, _unquoted(props.etag), age)

    # -- writes -------------------------------------------------------------------------------------
    def write_atomic(self, uri: str, data: bytes, *, durable: bool = True) -> None:
        """One Put Blob (a blob is seen only once its upload is committed)."""
        try:
            _call(self.path(uri), lambda blob: blob.upload_blob(data, overwrite=True))
        except OSError as exc:
            raise StorageError(f"cannot write {uri}: {exc}") from exc

    def create_if_absent(self, uri: str, data: bytes) -> str | None:
        """See :meth:`Store.create_if_absent`: a Put Blob with ``If-None-Match: *`` (409 or 412
        when the blob exists)."""
        return self._conditional_put(uri, data, overwrite=False)

    def replace_if_unchanged(self, uri: str, data: bytes, etag: str) -> str | None:
        return self._conditional_put(uri, data, overwrite=True, **_if_match(etag))

    def remove_if_unchanged(self, uri: str, etag: str) -> bool:
        try:
            _call(self.path(uri), lambda blob: blob.delete_blob(**_if_match(etag)), conditional=True)
        except _ConditionFailed:
            return False
        except OSError as exc:
            raise StorageError(f"cannot delete {uri}: {exc}") from exc
        return True

    def _conditional_put(self, uri: str, data: bytes, **condition: Any) -> str | None:
        """One Put Blob of ``data`` under ``condition``: its ETag, or None where the condition
        does not hold (409, 412, or 404 for a replace of a blob gone)."""
        try:
            resp = _call(self.path(uri), lambda blob: blob.upload_blob(data, **condition), conditional=True)
        except _ConditionFailed:
            return None
        except OSError as exc:
            raise StorageError(f"cannot write {uri}: the store refused the write: {exc}") from exc
        return _unquoted(resp.get("etag")) or ""


class _ConditionFailed(OSError):
    """A conditional request the store answered 409, 412 (or 404 for the blob): the condition
    does not hold."""


def _require_sdk() -> None:
    try:
        import adlfs  # noqa: F401  (only whether it is there)
        import azure.storage.blob  # noqa: F401
    except ImportError as exc:
        raise StorageError(_MISSING_SDK) from exc


def _account_of(settings: AzureSettings) -> str | None:
    if settings.account_name:
        return settings.account_name
    fields = dict(f.split("=", 1) for f in (settings.connection_string or "").split(";") if "=" in f)
    return fields.get("AccountName")


def _unquoted(etag: Any) -> str | None:
    if not isinstance(etag, str):
        return None
    return etag[1:-1] if len(etag) >= 2 and etag[0] == etag[-1] == '"' else etag


def _if_match(etag: str) -> dict[str, Any]:
    from azure.core import MatchConditions

    quoted = etag if etag.startswith(('"', "W/")) else f'"{etag}"'
    return {"etag": quoted, "match_condition": MatchConditions.IfNotModified}


def _call(path: str, op: Callable[[Any], Any], *, conditional: bool = False) -> Any:
    """``op(blob_client)`` of ``path`` (``container/blob``), its errors translated; with
    ``conditional``, a 409, a 412 or a blob gone (404 ``BlobNotFound``, not a missing container)
    is :class:`_ConditionFailed`."""
    from azure.core.exceptions import AzureError

    container, _, name = path.partition("/")
    blob = azure_client().get_blob_client(container, name)
    try:
        return op(blob)
    except AzureError as exc:
        status = getattr(exc, "status_code", None)
        if conditional and (status in (409, 412) or (status == 404 and error_code(exc) == "BlobNotFound")):
            raise _ConditionFailed(str(translated(exc, path))) from exc
        raise translated(exc, path) from exc


@dataclass(slots=True)
class _Tally:
    """What the pipeline sent for one download on this thread: requests (every attempt) and
    the last answer's ``Date``."""

    sent: int = 0
    date: str | None = None


#: The :class:`_Tally` of the download running on this thread, if any: the client's hooks
#: (:func:`_on_request`, :func:`_on_response`) run on the calling thread, once an attempt (a
#: hook given to one call would run for its first attempt only: the SDK pops it).
_ON_THREAD = threading.local()


def _on_request(_: Any) -> None:
    tally = getattr(_ON_THREAD, "tally", None)
    if tally is not None:
        tally.sent += 1


def _on_response(resp: Any) -> None:
    tally = getattr(_ON_THREAD, "tally", None)
    if tally is not None:
        tally.date = resp.http_response.headers.get("Date")
    _read_body_whole(resp.http_response)


def _read_body_whole(response: Any) -> None:
    """Have a downloaded body read in one piece: the SDK streams it ``block_size`` bytes at a
    time (4 KiB unless told), each piece copied by urllib3 and then joined by the downloader; a
    block of exactly the body's length is read into one buffer and handed on as it is, as boto3
    reads an S3 body (the client's CPU a read: docs/performance.md)."""
    length = response.headers.get("Content-Length")
    if length and length.isdigit() and int(length) > 0:
        response.block_size = int(length)


def _download(
    path: str, offset: int | None, length: int | None, if_match: str | None, stats: RequestStats | None
) -> tuple[bytes, Any, dt.datetime | None]:
    """The body, the blob's properties and the answer's ``Date`` of one download of ``path``
    (``container/blob``), counted in ``stats`` (requests: every one the pipeline sent, retries
    and GETs again of a body cut off included)."""
    began, tally = time.perf_counter(), _Tally()

    def count(nbytes: int, error: str | None = None) -> None:
        if stats is not None:
            stats.add(
                requests=tally.sent,
                retries=max(tally.sent - 1, 0),
                nbytes=nbytes,
                seconds=time.perf_counter() - began,
                error=error,
            )

    kwargs = _if_match(if_match) if if_match else {}
    _ON_THREAD.tally = tally
    try:
        downloader = _call(path, lambda blob: blob.download_blob(offset, length, **kwargs))
        data = b"".join(downloader.chunks())  # readall() copies the body once more, through a BytesIO
    except OSError as exc:
        count(0, _error_kind(exc))
        raise
    except Exception as exc:  # a body cut off once too often, a connection that stays down
        count(0, type(exc).__name__)
        raise OSError(f"az://{path}: {type(exc).__name__}: {exc}") from exc
    finally:
        _ON_THREAD.tally = None
    count(len(data))
    return data, downloader.properties, _date(tally.date)


def _error_kind(exc: OSError) -> str:
    return error_code(exc.__cause__ or exc)


def _utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t


def _date(header: str | None) -> dt.datetime | None:
    try:
        return email.utils.parsedate_to_datetime(header) if header else None
    except (TypeError, ValueError):
        return None


#: The blocking clients of this process (:func:`azure_client`), by process id and settings.
_CLIENTS: dict[tuple[int, str], Any] = {}
_CLIENTS_LOCK = threading.Lock()
#: Connections a blocking client keeps to the store (as ``s3_client``'s).
CLIENT_CONNECTIONS = 64


def azure_client() -> Any:
    """A blocking ``BlobServiceClient`` with the environment's settings (:func:`azure_settings`),
    one per process and settings; the SDK's clients are safe to share between threads."""
    settings = azure_settings()
    key = (os.getpid(), json.dumps(settings.fs_options(), sort_keys=True))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _new_client(settings)
    return client


def clear_azure_clients() -> None:
    """Forget the clients :func:`azure_client` made, as a new process has none."""
    with _CLIENTS_LOCK:
        _CLIENTS.clear()


def _new_client(settings: AzureSettings) -> Any:
    _require_sdk()
    import requests
    from azure.storage.blob import BlobServiceClient

    session = without_netrc(requests.Session())
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=CLIENT_CONNECTIONS)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    options: dict[str, Any] = {
        "retry_policy": retry_policy(),
        "max_single_get_size": _SINGLE_GET,
        "connection_timeout": 10,
        "read_timeout": 60,
        "session": session,
        "raw_request_hook": _on_request,
        "raw_response_hook": _on_response,
    }
    return service_client(BlobServiceClient, settings, options, aio=False)
