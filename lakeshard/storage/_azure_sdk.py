"""The Azure SDK as :class:`~lakeshard.storage._azure.AzureStore` uses it (design/0042): the
settings, the retry policy and the service clients (blocking, and asyncio for adlfs) made from
them, adlfs's filesystem (listings, Arrow datasets, Parquet files) on that client, and the SDK's
errors as Python's naming the ``az://`` URI."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["AzureSettings", "error_code", "filesystem_class", "retry_policy", "service_client", "translated"]

#: Attempts of a request after the first (5 in all, as botocore's for S3): 5xx, 503 ServerBusy
#: and connection errors (:func:`retry_policy`); 403 and 404 fail at once.
_RETRIES = 4


@functools.cache
def filesystem_class() -> type:
    """adlfs's filesystem as the store uses it: its asyncio client built from the same settings
    and retrying as the blocking one (:func:`retry_policy`; adlfs builds its client with the
    SDK's default policy, whose backoff starts at 15 s, and takes no policy of its own), and the
    SDK's errors of its reads, writes and listings raised as Python's naming the ``az://`` URI
    (:func:`translated`), as fsspec's filesystems raise them (adlfs lets a 500 or a body still
    cut off after the retries through as ``HttpResponseError``)."""
    from adlfs import AzureBlobFile, AzureBlobFileSystem
    from azure.storage.blob.aio import BlobServiceClient

    class File(AzureBlobFile):
        def _fetch_range(self, start: int, end: int | None = None, **kwargs: Any) -> Any:
            with _as_oserror(self.path):
                return super()._fetch_range(start, end, **kwargs)

        def _initiate_upload(self, **kwargs: Any) -> Any:
            with _as_oserror(self.path):
                return super()._initiate_upload(**kwargs)

        def _upload_chunk(self, final: bool = False, **kwargs: Any) -> Any:
            with _as_oserror(self.path):
                return super()._upload_chunk(final, **kwargs)

    class FileSystem(AzureBlobFileSystem):
        def do_connect(self) -> None:
            settings = AzureSettings(
                self.connection_string, self.account_name, self.account_key, self.sas_token
            )
            options = {"retry_policy": retry_policy(aio=True)}
            self.service_client = service_client(BlobServiceClient, settings, options, aio=True)

        def _open(self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs: Any) -> Any:
            kwargs.setdefault("cache_type", "readahead")  # adlfs's own default in _open
            return File(self, path, mode, block_size or self.blocksize, **kwargs)

        async def _info(self, path: str, **kwargs: Any) -> Any:
            with _as_oserror(self._strip_protocol(path)):
                return await super()._info(path, **kwargs)

        async def _ls(self, path: str, **kwargs: Any) -> Any:
            with _as_oserror(self._strip_protocol(path)):
                return await super()._ls(path, **kwargs)

        async def _cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
            with _as_oserror(self._strip_protocol(path)):
                return await super()._cat_file(path, *args, **kwargs)

    return FileSystem


@contextmanager
def _as_oserror(path: str) -> Iterator[None]:
    """The SDK's errors about ``path`` (``container/blob``) as Python's (:func:`translated`)."""
    from azure.core.exceptions import AzureError

    try:
        yield
    except AzureError as exc:
        raise translated(exc, path) from exc


@dataclass(frozen=True, slots=True)
class AzureSettings:
    """Where the credentials come from (see the module doc): one of ``connection_string``, or
    ``account_name`` with ``account_key``, ``sas_token`` or neither (azure-identity's chain)."""

    connection_string: str | None = None
    account_name: str | None = None
    account_key: str | None = None
    sas_token: str | None = None

    def fs_options(self) -> dict[str, Any]:
        """Keyword arguments for adlfs's ``AzureBlobFileSystem``."""
        given = {
            "connection_string": self.connection_string,
            "account_name": self.account_name,
            "account_key": self.account_key,
            "sas_token": self.sas_token,
        }
        # Listings must be fresh: a rerun after a kill lists what is there now.
        return {k: v for k, v in given.items() if v} | {"use_listings_cache": False}


def service_client(cls: Any, settings: AzureSettings, options: dict[str, Any], *, aio: bool) -> Any:
    """A ``BlobServiceClient`` of ``cls`` (blocking or asyncio) for ``settings``. The blocking
    one's requests session is the caller's (in ``options``, made by ``without_netrc``); the
    asyncio one reads the environment's proxies for its endpoint once, here (:func:`_env_proxies`)."""
    if settings.connection_string:

        def made(**more: Any) -> Any:
            return cls.from_connection_string(settings.connection_string, **options, **more)

        return made(**_env_proxies(made().url)) if aio else made()
    account_url = f"https://{settings.account_name}.blob.core.windows.net"
    if aio:
        options = options | _env_proxies(account_url)
    if settings.account_key:
        credential: Any = {"account_name": settings.account_name, "account_key": settings.account_key}
    elif settings.sas_token:
        credential = settings.sas_token.removeprefix("?")
    elif aio:
        from azure.identity.aio import DefaultAzureCredential as AioDefaultAzureCredential

        credential = AioDefaultAzureCredential()
    else:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return cls(account_url, credential=credential, **options)


def _env_proxies(url: str) -> dict[str, Any]:
    """The asyncio client's options for ``url``: aiohttp trusting the environment (the SDK's
    default) also takes a ``~/.netrc`` entry for the host and then refuses it beside the SDK's
    ``Authorization`` header ("Cannot combine AUTHORIZATION header with AUTH argument"), on
    every request. So it does not read the environment; the proxies the environment names for
    ``url`` (``HTTPS_PROXY``, ``NO_PROXY``, ..., as requests reads them) are given to it instead."""
    from requests.utils import get_environ_proxies

    return {"use_env_settings": False, "proxies": get_environ_proxies(url) or None}


def retry_policy(*, aio: bool = False) -> Any:
    """The SDK's exponential retry (which requests, and 5 attempts in all), backing off as
    botocore's standard mode does for S3 (0.1 s growing to at most 5 s, jittered): the SDK's
    own backoff starts at 15 s and takes integers only. ``aio``: the asyncio client's."""
    from azure.storage.blob import ExponentialRetry
    from azure.storage.blob.aio import ExponentialRetry as AioExponentialRetry

    class _Retry(AioExponentialRetry if aio else ExponentialRetry):  # type: ignore[misc]
        def get_backoff_time(self, settings: dict[str, Any]) -> float:
            backoff = min(0.1 * 1.7 ** settings["count"], 5.0)
            return backoff * (0.5 + random.random())

    return _Retry(retry_total=_RETRIES)


def translated(exc: Exception, path: str) -> OSError:
    """What Python raises for a file: ``FileNotFoundError`` (404), ``PermissionError`` (403),
    else ``OSError``, naming the URI and Azure's error code (never a credential)."""
    status = getattr(exc, "status_code", None)
    code = error_code(exc)
    message = f"az://{path}: {status or ''} {code}".replace("  ", " ")
    if status is None:  # no answer to name (a connection lost, a body cut off): the SDK's words
        message += f": {str(getattr(exc, 'message', exc)).splitlines()[0][:200]}"
    if status == 404:
        return FileNotFoundError(2, message)
    if status == 403:
        return PermissionError(13, message)
    return OSError(message)


def error_code(exc: BaseException) -> str:
    """Azure's error code of ``exc`` (``BlobNotFound``, ``ServerBusy``), else its type's name."""
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or type(exc).__name__)
