"""What a store is: the :class:`Store` protocol every scheme implements, what its reads hand
back (:class:`Blob`, :class:`Tail`) and how its requests are counted (:class:`RequestStats`).

Every method takes a URI of its own store, canonical as :meth:`Store.normalize` gives it (an
``s3://`` prefix ending in ``/`` stays a prefix). ETags are unquoted everywhere; a store quotes
them where its protocol wants them quoted. Reads raise what Python raises for a file
(``FileNotFoundError``, ``PermissionError``, ``OSError``); writes raise ``StorageError`` naming
the URI.
"""

from __future__ import annotations

import abc
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lakeshard.errors import StorageError

__all__ = [
    "Blob",
    "BucketStore",
    "RequestCounts",
    "RequestStats",
    "Store",
    "Tail",
    "split_scheme",
    "without_netrc",
]

#: A URI scheme, as RFC 3986 spells one (``urlsplit`` would also cut ``#...`` and ``?...`` off
#: the rest, which are part of a key or file name here).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def split_scheme(uri: str) -> tuple[str, str]:
    """``(scheme, rest)`` of ``uri``, the scheme lower-cased; ``("", uri)`` for a plain path.
    A one-letter scheme is a Windows drive, and a path."""
    match = _SCHEME.match(uri)
    if match is None or len(match.group(1)) == 1:
        return "", uri
    return match.group(1).lower(), uri[match.end() :]


@dataclass(frozen=True, slots=True)
class Blob:
    """An object's bytes as one read got them, and what that very read said of it."""

    data: bytes
    etag: str | None  #: unquoted
    age_s: float  #: seconds since the object was last written, by the store's clock


@dataclass(frozen=True, slots=True)
class Tail:
    """The last bytes of an object (:meth:`Store.read_tail`) and what the same answer said of it."""

    data: bytes
    size: int  #: the whole object's size in bytes
    etag: str | None  #: unquoted; ``None`` where the read did not learn it (a local file)


class Store(abc.ABC):
    """One kind of storage, named by a URI scheme (:func:`lakeshard.storage.store_for` picks it).

    A store is one object a process, shared by threads; it holds no open file or connection of
    its own (a client, where it has one, is kept by the module that makes it). What it must
    give:

    * names: :meth:`normalize`, :meth:`path` and :meth:`uri` between a URI and the path within
      :meth:`filesystem` (fsspec's: listings, Arrow datasets and Parquet writers go through it);
    * reads: :meth:`read` (the whole object or a byte range, in one request), :meth:`read_tail`
      (its last bytes and its size, in one request), :meth:`get` (its bytes with their ETag);
    * writes: :meth:`write_atomic` (readers see the old bytes or the new, never a part), the
      conditional writes (:meth:`create_if_absent`, :meth:`replace_if_unchanged`,
      :meth:`remove_if_unchanged`: one step no other writer comes between), :meth:`rename`.

    :meth:`exists`, :meth:`remove` and :meth:`remove_temporaries` have their fsspec (and
    object store) meaning here; a store overrides what it does otherwise.
    """

    #: The scheme of this store's canonical URIs (``"file"``, ``"s3"``).
    scheme: ClassVar[str]
    #: Whether its URIs are files of this machine (renames, ``flock``, Arrow's own reader).
    local: ClassVar[bool] = False

    # -- names --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def normalize(self, uri: str) -> str:
        """``uri`` (of this store's scheme or its aliases) in canonical form, no trailing slash.

        Raises:
            StorageError: a URI this store cannot name (an ``s3://`` URI without a bucket)."""

    @abc.abstractmethod
    def path(self, uri: str) -> str:
        """The path of ``uri`` within :meth:`filesystem` (``bucket/key``, ``/abs/path``), taken
        as it is spelt when canonical (a trailing ``/`` kept), else normalized first."""

    def uri(self, path: str) -> str:
        """A path as :meth:`filesystem` lists it, as a URI of this store (the inverse of :meth:`path`)."""
        return f"{self.scheme}://{path}"

    @abc.abstractmethod
    def filesystem(self) -> Any:
        """The fsspec filesystem of this store (fsspec caches instances: cheap to ask again)."""

    def listed_etag(self, info: dict[str, Any]) -> str | None:
        """The ETag (unquoted) of an object as :meth:`filesystem` lists it (``info``: fsspec's
        details), the one :meth:`get` gives; None where the listing has none (a local file)."""
        etag = info.get("ETag") or info.get("etag")
        return etag.strip('"') if isinstance(etag, str) else None

    def listed_md5(self, info: dict[str, Any]) -> str | None:
        """The MD5 of an object's bytes (hex) as its listing ``info`` states it, so the object
        need not be read to know its content; None where the listing states none. Here: the
        ETag of an object written in one upload (S3's), not a multipart upload's
        (``<md5 of the parts' md5s>-<parts>``); a local file's listing has no ETag."""
        etag = self.listed_etag(info)
        return etag if etag is not None and "-" not in etag else None

    # -- reads --------------------------------------------------------------------------------------
    def exists(self, uri: str) -> bool:
        try:
            return bool(self.filesystem().exists(self.path(uri)))
        except Exception as exc:  # a permission or endpoint error must name the URI
            raise StorageError(f"cannot check {uri}: {exc}") from exc

    @abc.abstractmethod
    def read(
        self,
        uri: str,
        start: int = 0,
        end: int | None = None,
        *,
        if_match: str | None = None,
        stats: RequestStats | None = None,
    ) -> bytes:
        """Bytes ``[start, end)`` of the object at ``uri`` (to its end if ``end`` is None; fewer
        where it is shorter), in one request, blocking the calling thread. ``if_match``: the
        object must still have this ETag, else this raises (``OSError``), never other bytes.
        ``stats`` counts the read (its requests, retries included, bytes, time, or its error)."""

    @abc.abstractmethod
    def read_tail(self, uri: str, n: int) -> Tail:
        """The last ``n`` bytes of the object at ``uri`` (all of it if it is shorter), with its
        size, in one request (no stat first)."""

    @abc.abstractmethod
    def get(self, uri: str) -> Blob:
        """The whole object at ``uri`` with the ETag of the very bytes read (no second request,
        no race between a stat and the read)."""

    # -- writes -------------------------------------------------------------------------------------
    def write_atomic(self, uri: str, data: bytes, *, durable: bool = True) -> None:
        """Write ``data`` so that readers see the old object or the new one, never a part: here one
        upload, which an object store shows only once complete. ``durable``: the bytes are on
        disk when this returns (a local store may skip the fsync of a scratch file without)."""
        try:
            self.filesystem().pipe_file(self.path(uri), data)
        except Exception as exc:
            raise StorageError(f"cannot write {uri}: {exc}") from exc

    @abc.abstractmethod
    def create_if_absent(self, uri: str, data: bytes) -> str | None:
        """Create ``uri`` holding ``data`` unless something is there already, in one step no other
        writer can come between: the new object's ETag if this call created it, None if it was
        there.

        Raises:
            NoConditionalWrites: the store refused the condition itself (it has none).
            StorageError: the write failed."""

    @abc.abstractmethod
    def replace_if_unchanged(self, uri: str, data: bytes, etag: str) -> str | None:
        """Write ``data`` over ``uri`` only if its ETag is still ``etag``: the new ETag, or None if
        the object changed or is gone since."""

    @abc.abstractmethod
    def remove_if_unchanged(self, uri: str, etag: str) -> bool:
        """Delete ``uri`` only if its ETag is still ``etag``: whether it was deleted (False: it
        changed or is gone)."""

    def remove(self, uri: str, *, recursive: bool = False) -> None:
        """Delete ``uri`` if it exists (a folder, or every object under a prefix, with ``recursive``)."""
        fs, path = self.filesystem(), self.path(uri)
        try:
            if fs.exists(path):
                fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise StorageError(f"cannot delete {uri}: {exc}") from exc

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` (a file or a folder) onto ``dst``, both of this store, in one atomic step.

        Raises:
            StorageError: the store has no rename (an object store: a move there copies every
                byte; write the object where it stays), or the rename failed."""

    def remove_temporaries(self, uri: str) -> list[str]:
        """Delete what writers killed before their rename left under ``uri`` and return its
        paths: nothing here (an object appears whole when its upload completes)."""
        return []


class BucketStore(Store):
    """A store of objects named ``<scheme>://bucket/key`` (S3, GCS, Azure's
    ``az://container/blob``): the key taken literally, as the clouds' own command lines take it;
    no rename (a move there copies every byte)."""

    #: The store's name in messages (``"S3"``, ``"GCS"``, ``"Azure"``).
    title: ClassVar[str]
    #: What the store calls a bucket, in messages (Azure's ``"container"``).
    bucket_word: ClassVar[str] = "bucket"

    def normalize(self, uri: str) -> str:
        rest = split_scheme(uri)[1]
        bucket, _, key = rest.removeprefix("//").partition("/")
        if not rest.startswith("//") or not bucket:
            raise StorageError(f"{self.title} URI {uri!r} names no {self.bucket_word}")
        key = key.strip("/")
        return f"{self.scheme}://{bucket}/{key}" if key else f"{self.scheme}://{bucket}"

    def path(self, uri: str) -> str:
        prefix = f"{self.scheme}://"
        return uri[len(prefix) :] if uri.startswith(prefix) else self.normalize(uri)[len(prefix) :]

    def rename(self, src: str, dst: str) -> None:
        raise StorageError(
            f"cannot move {src} to {dst}: only local files are renamed ({self.title} has no rename; "
            "write the object where it stays)"
        )


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
    """Requests to a store, counted by the code that sends them (:meth:`Store.read`'s ``stats``);
    safe to share between threads. ``counts()`` is what was counted so far."""

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


def without_netrc(session: Any) -> Any:
    """``session`` (a ``requests.Session``), never taking credentials from ``~/.netrc``.

    requests puts a ``~/.netrc`` entry for the request's host, or the file's ``default`` entry,
    over the ``Authorization`` header the cloud's client set
    (https://github.com/psf/requests/issues/3929): every request then went out with the netrc's
    login and password as Basic credentials, and Azure answered 403 (GCS 401). A session-wide authentication that changes nothing stops that
    lookup; the environment's proxies, ``NO_PROXY`` and CA bundle still apply (``trust_env``)."""
    session.auth = _unchanged
    return session


def _unchanged(request: Any) -> Any:
    return request
