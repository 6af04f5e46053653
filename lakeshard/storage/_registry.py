"""Which store a URI names: decided here, and only here (``tests/test_layering.py`` holds the
rest of the code to it), by its scheme, in one table: ``file`` (and a plain path) for
:class:`LocalStore`, ``s3`` and ``s3a`` for :class:`S3Store`, ``gs`` and ``gcs`` for
:class:`GCSStore`, ``az`` (and ``abfs``, ``abfss``) for :class:`AzureStore`. Another store is one
:func:`register_store` call, as litdata's ``register_downloader`` adds one.

Everything that names stores without doing I/O sits here too: :func:`normalize`,
:func:`scheme`, :func:`is_local`, :func:`is_uri`, :func:`local_path`, :func:`bucket`,
:func:`from_listing`, :func:`join`, :func:`filesystem`.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterable
from typing import Any

from lakeshard.errors import StorageError
from lakeshard.storage._azure import AzureStore
from lakeshard.storage._gcs import GCSStore
from lakeshard.storage._local import LocalStore
from lakeshard.storage._s3 import S3Store
from lakeshard.storage._store import Store, split_scheme

__all__ = [
    "bucket",
    "filesystem",
    "from_listing",
    "is_local",
    "is_uri",
    "join",
    "local_path",
    "normalize",
    "register_store",
    "scheme",
    "store_for",
    "unregister_store",
]

#: What makes the store of each scheme, aliases included, with the scheme it is registered under
#: (in the order registered); and the store each made, once a process.
_FACTORIES: dict[str, tuple[str, Callable[[], Store]]] = {}
_STORES: dict[str, Store] = {}
_LOCK = threading.Lock()


def register_store(
    scheme: str, factory: Callable[[], Store], *, aliases: Iterable[str] = (), replace: bool = False
) -> None:
    """Make ``factory()`` (a :class:`Store`, made on first use, one a process) the store of URIs
    of ``scheme`` (and of each of ``aliases``, which its :meth:`Store.normalize` turns into
    ``scheme``).

    Raises:
        StorageError: a scheme already taken (unless ``replace``), or not a URI scheme of at
            least two characters (one letter is a Windows drive)."""
    scheme = scheme.lower()
    names = [scheme, *(a.lower() for a in aliases)]
    for name in names:
        if split_scheme(f"{name}://")[0] != name:
            raise StorageError(f"scheme must be a URI scheme of two or more characters, got {name!r}")
        if name in _FACTORIES and not replace:
            raise StorageError(f"scheme {name!r} has a store already; pass replace=True to replace it")
    with _LOCK:
        for name in names:
            _FACTORIES[name] = (scheme, factory)
        for name in [n for n, (s, _) in _FACTORIES.items() if s == scheme]:
            _STORES.pop(name, None)


def unregister_store(scheme: str) -> None:
    """Forget the store of ``scheme`` and its aliases (a test's own store)."""
    scheme = scheme.lower()
    with _LOCK:
        for name in [n for n, (s, _) in _FACTORIES.items() if s == scheme]:
            del _FACTORIES[name]
            _STORES.pop(name, None)


def store_for(uri: str) -> Store:
    """The store of ``uri``, by its scheme (a plain path is a local file). Cheap: no
    normalisation, fit for every row of a listing.

    Raises:
        StorageError: ``uri`` is not a non-empty string, or its scheme has no store (naming
            the scheme and the URI)."""
    if not isinstance(uri, str) or not uri.strip():
        raise StorageError(f"a URI must be a non-empty string, got {uri!r}")
    name = split_scheme(uri)[0] or "file"
    store = _STORES.get(name) or _made(name)
    if store is None:
        known = [f"{s}://" for s in dict.fromkeys(s for s, _ in _FACTORIES.values())]
        choices = ", ".join(known[:-1]) + " or " + known[-1] if len(known) > 1 else "".join(known)
        raise StorageError(f"unsupported URI scheme {name!r} in {uri!r}: use a local path, {choices}")
    return store


def _made(name: str) -> Store | None:
    """The store of scheme ``name``, made now if it was not yet (one for a scheme and its
    aliases); None if none is registered."""
    with _LOCK:
        store = _STORES.get(name)
        if store is None and name in _FACTORIES:
            scheme, factory = _FACTORIES[name]
            store = factory()
            for alias in [n for n, (s, _) in _FACTORIES.items() if s == scheme]:
                _STORES[alias] = store
        return store


def normalize(uri: str) -> str:
    """Return ``uri`` in canonical form: ``s3://bucket/key`` or ``file:///abs/path``, no
    trailing slash.

    The key or path after the scheme is taken literally, as the AWS CLI takes an ``s3://`` URI:
    ``#``, ``?``, ``%20`` and ``+`` are part of the name (``photo #1.jpg`` is a file name, not
    ``photo `` and a fragment), so a URI made by joining a listed name onto a prefix always
    names that object again.
    """
    return store_for(uri).normalize(uri)


def scheme(uri: str) -> str:
    """The store of ``uri``: ``"file"`` (a path or ``file://``), ``"s3"`` (``s3://``, ``s3a://``),
    ``"gs"`` (``gs://``, ``gcs://``) or ``"az"`` (``az://``, ``abfs://``, ``abfss://``).

    Raises:
        StorageError: another scheme (as :func:`normalize`)."""
    return normalize(uri).split(":", 1)[0]


def is_local(uri: str) -> bool:
    """Whether ``uri`` names a local file (a path or ``file://``), not an object in a store (nor
    a URI of no store). Cheap (no normalisation): fit for every row of a listing."""
    name = split_scheme(uri)[0] or "file"
    store = _STORES.get(name) or _made(name)
    return store is not None and store.local


def is_uri(ref: str) -> bool:
    """Whether ``ref`` is a URI of a store this package reads, with its scheme spelt out
    (``s3://...`` or ``file://...``), not a bare path."""
    name, rest = split_scheme(ref)
    return name in _FACTORIES and rest.startswith("//")


def local_path(uri: str) -> str:
    """The absolute path of a local ``uri``.

    Raises:
        StorageError: ``uri`` names an object in a store."""
    store = store_for(uri)
    root = store.normalize(uri)
    if not store.local:
        raise StorageError(f"not a local path: {uri!r}")
    return store.path(root)


def bucket(uri: str) -> str:
    """The bucket (an Azure container) of an object store's ``uri`` (``s3://``, ``gs://``, ``az://``).

    Raises:
        StorageError: ``uri`` is a local path."""
    store = store_for(uri)
    root = store.normalize(uri)
    if store.local:
        raise StorageError(f"not a URI of an object store: {uri!r}")
    return store.path(root).lstrip("/").split("/", 1)[0]


def from_listing(root: str, path: str) -> str:
    """``path`` as the filesystem of ``root``'s store lists it (:func:`filesystem`: ``/abs/path``
    on a local disk, ``bucket/key`` on S3), as a URI of that store."""
    return store_for(root).uri(path)


def filesystem(uri: str) -> tuple[Any, str]:
    """The fsspec filesystem for ``uri`` and the path within it.

    Instances are cached by fsspec, so calling this once per task in an executor is cheap.
    """
    store = store_for(uri)
    return store.filesystem(), store.path(store.normalize(uri))


def join(uri: str, *parts: str) -> str:
    """Join path components onto a URI with ``/``."""
    uri = normalize(uri)
    return posixpath.join(uri, *parts) if parts else uri


register_store("file", LocalStore)
register_store("s3", S3Store, aliases=("s3a",))
register_store("gs", GCSStore, aliases=("gcs",))
register_store("az", AzureStore, aliases=("abfs", "abfss"))
