"""Listing a lake in balanced tasks: no task lists more than ``task_objects`` objects.

:func:`list_lake` starts with one unit per class prefix (a :class:`ListUnit`), a few units a
task (at most four tasks per core: a thousand classes are not a thousand tasks, each an engine
task to schedule and a part file to write). A task lists its units in key order; once it has
listed ``task_objects`` objects it stops and hands back, as new units, everything it has not
listed, cut into pieces the next round runs in parallel. The driver holds only units (a few per
task), never a key it did not get as a row:

- **Local**: a unit is a folder and a range of its entry names (``after < name <= upto``,
  sorted, each entry walked recursively). A task that stops hands back, for each folder it is
  inside, the rest of its entries in ranges of at most ``task_objects`` names (reading a
  folder's names is one cheap call; only the entries in a task's range are stat'ed).
- **S3, GCS and Azure**: a unit is a key prefix (any string, not only a folder) and a key to
  start after: the listing's own order (S3's ListObjectsV2 ``StartAfter``; GCS's JSON API
  ``startOffset`` and Azure's List Blobs ``startFrom``, which include the key they name, so
  that key is dropped). A task that stops
  after key ``L`` finds what is left by seeking (one key a request: one request per unit made)
  and hands back the smallest key prefixes that hold every remaining key and no listed one: one
  more delimiter level where there are sub-folders, a key range (the next character) where the
  prefix is flat.

Rows are the ones :func:`jobs.manifest_steps.listing.list_prefix` makes (same keys, labels, sizes, ETags;
links, loops, hidden and excluded objects alike): only who lists which key changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from jobs.common.engines import Engine
from jobs.manifest_steps.listing import (
    _NO_SKIP,
    Skip,
    StagedRow,
    _chain,
    _folder_loop,
    _ident,
    _local_entry,
    _row,
)
from lakeshard import storage
from lakeshard.errors import StorageError

__all__ = ["ListUnit", "list_lake", "list_units"]

log = logging.getLogger(__name__)

#: The largest code point: ``prefix + _LAST`` sorts after every key starting with ``prefix``
#: (but a key holding U+10FFFF right after it, which :func:`_rest_of` still lists once).
_LAST = "\U0010ffff"
_PAGE = 1000  # the largest page of ListObjectsV2 and of GCS's objects list


@dataclass(frozen=True, slots=True)
class ListUnit:
    """A piece of a class prefix one task lists.

    Local: ``uri`` is a folder, and its entries named in ``(after, upto]`` (None: no bound)
    are listed recursively. S3, GCS and Azure: ``uri`` is ``<scheme>://bucket/<key prefix>`` and the
    keys starting with that prefix and greater than ``after`` (a whole key) are listed;
    ``upto`` is None.
    """

    uri: str
    after: str | None = None
    upto: str | None = None
    #: a class prefix as discovery found it; False: a piece of one, which may hold no object
    #: (an Azure folder's blob alone)
    whole: bool = True

    def sort_key(self) -> tuple[str, str, str]:
        return self.uri, self.after or "", self.upto or ""


def _chunks(path: str, names: Sequence[str], start: int, after: str | None, size: int) -> list[ListUnit]:
    """``names[start:]`` of the local folder ``path`` as units of at most ``size`` names."""
    units = []
    for s in range(start, len(names), size):
        e = min(s + size, len(names))
        units.append(
            ListUnit(
                storage.from_listing("file://", path),
                after=names[s - 1] if s > 0 else after,
                upto=names[e - 1],
                whole=False,
            )
        )
    return units


def _names(path: str, after: str | None, upto: str | None) -> list[str]:
    return [
        n for n in sorted(os.listdir(path)) if (after is None or n > after) and (upto is None or n <= upto)
    ]


@dataclass(slots=True)
class _Frame:
    """A local folder being walked: its entry names (in range), the next one, the lower bound
    of the range and the loop chain of the folders above its entries."""

    path: str
    chain: frozenset[tuple[int, int]]
    names: list[str]
    after: str | None = None
    next: int = 0

    def rest(self, size: int) -> list[ListUnit]:
        return _chunks(self.path, self.names, self.next, self.after, size)


class _UnitListed(NamedTuple):
    """A unit's objects listed (their infos, at most the task's budget) and the units of what
    is left of it."""

    infos: list[dict[str, Any]]
    rest: list[ListUnit]


def _list_local_unit(root_path: str, unit: ListUnit, budget: int) -> _UnitListed:
    """The infos of ``unit``'s objects (at most ``budget``) and the units of what is left."""
    path = storage.filesystem(unit.uri)[1]
    chain = _chain(root_path, path)
    if unit.after is None and unit.upto is None and (loop := _folder_loop(path, chain)) is not None:
        return _UnitListed([loop], [])
    frames = [_Frame(path, chain | {_ident(os.stat(path))}, _names(path, unit.after, unit.upto), unit.after)]
    infos: list[dict[str, Any]] = []
    while frames:
        frame = frames[-1]
        if frame.next == len(frame.names):
            frames.pop()
            continue
        if len(infos) >= budget:
            return _UnitListed(infos, [u for f in frames for u in f.rest(budget)])
        name = frame.names[frame.next]
        frame.next += 1
        entry = _local_entry(frame.path, name, frame.chain)
        if entry.folder is None:
            infos.append(entry.info)
        else:
            frames.append(_Frame(entry.path, frame.chain | {entry.folder}, sorted(os.listdir(entry.path))))
    return _UnitListed(infos, [])


class _Page(NamedTuple):
    """One page of a listing: the infos of its objects (in key order, all after the key asked
    to start after), the token of the next page (None: this was the last) and the page's first
    key (None: the page is empty), which has no info where it is not an object (an Azure folder)."""

    infos: list[dict[str, Any]]
    token: str | None
    first: str | None


#: One page of ``fs``'s listing of ``bucket`` below the key ``prefix``: at most ``size`` keys
#: after ``after`` (None: from the first), from the page ``token`` names (None: the first).
_Pager = Callable[[Any, str, str, str | None, int, str | None], _Page]


def _s3_page(fs: Any, bucket: str, prefix: str, after: str | None, size: int, token: str | None) -> _Page:
    """A page of ListObjectsV2 through s3fs's client."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": size, **fs.req_kw}
    if after is not None:
        kwargs["StartAfter"] = after
    if token is not None:
        kwargs["ContinuationToken"] = token
    page = fs.call_s3("list_objects_v2", **kwargs)
    infos = [
        {
            "name": f"{bucket}/{c['Key']}",
            "size": c["Size"],
            "ETag": c.get("ETag"),
            "LastModified": c.get("LastModified"),
        }
        for c in page.get("Contents", [])
    ]
    token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
    return _Page(infos, token, page["Contents"][0]["Key"] if infos else None)


def _gcs_page(fs: Any, bucket: str, prefix: str, after: str | None, size: int, token: str | None) -> _Page:
    """A page of the JSON API's objects list through gcsfs, its infos as gcsfs's ``find`` gives
    them. ``startOffset`` includes the key it names: the first page asks for one more and drops
    ``after`` itself (all it answers is kept, the next page following the last: where ``after``
    is gone, that is ``size + 1`` keys, never a key lost)."""
    params: dict[str, Any] = {"prefix": prefix, "maxResults": size}
    if after is not None:
        params["startOffset"] = after
        params["maxResults"] += token is None
    if token is not None:
        params["pageToken"] = token
    page = fs.call("GET", "b/{}/o", bucket, json_out=True, **params)
    items = [i for i in page.get("items", []) if i["name"] != after]
    # gcsfs's own conversion (sizes, times, generations): the rows of `find` and of these pages agree.
    infos = [fs._process_object(bucket, i) for i in items]
    return _Page(infos, page.get("nextPageToken"), items[0]["name"] if items else None)


#: An Azure endpoint that lists from the first blob whatever ``startFrom`` says (a service
#: version before 2026-02-06: Azurite before 3.37, Azure Stack): its pages would repeat keys.
_NO_START_FROM = (
    "this Azure endpoint ignores List Blobs' startFrom (service version 2026-02-06; Azurite 3.37 "
    "and later), with which a class prefix of more than --list-task-objects blobs is cut into "
    "tasks: pass a --list-task-objects above the largest class's blob count to list each class in one task"
)


def _azure_page(
    fs: Any, container: str, prefix: str, after: str | None, size: int, token: str | None
) -> _Page:
    """A page of List Blobs through adlfs's client, its infos as adlfs's ``find`` gives them:
    files only (a folder of a hierarchical namespace is a blob too, a key of the page without an
    info). ``startFrom`` includes the blob it names, as GCS's ``startOffset`` does
    (:func:`_gcs_page`); the service keeps it on the pages that follow."""
    from fsspec.asyn import sync

    async def page() -> _Page:
        first_page = after is not None and token is None
        async with fs.service_client.get_container_client(container) as client:
            pages = client.list_blobs(
                name_starts_with=prefix,
                include=["metadata"],
                results_per_page=size + first_page,
                **({"start_from": after} if after is not None else {}),
            ).by_page(continuation_token=token)
            try:
                blobs = [b async for b in await anext(pages)]
            except StopAsyncIteration:
                return _Page([], None, None)
            if after is not None and blobs and blobs[0].name < after:
                raise StorageError(_NO_START_FROM)
            blobs = [b for b in blobs if b.name != after]
            # adlfs's own conversion (the "file" or "directory" of each): the rows of `find` and of these pages agree.
            infos = [i for i in await fs._details(blobs) if i["type"] == "file"]
            return _Page(infos, pages.continuation_token or None, blobs[0].name if blobs else None)

    return sync(fs.loop, page)


#: The stores whose listing can start after a key, by scheme (another's prefixes are listed
#: whole: :func:`_list_whole_unit`).
_PAGERS: dict[str, _Pager] = {"s3": _s3_page, "gs": _gcs_page, "az": _azure_page}


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _rest_of(pager: _Pager, fs: Any, unit: ListUnit, last: str) -> list[ListUnit]:
    """The smallest key prefixes under ``unit``'s that together hold every key after ``last``
    (and none before): found by seeking, one request per prefix and one more."""
    scheme, bucket, prefix = _named(unit)
    units: list[ListUnit] = []
    pos = last
    while True:
        key = pager(fs, bucket, prefix, pos, 1, None).first
        if key is None:
            return units
        node = key[: _common(key, last) + 1]
        if not units or units[-1].uri != f"{scheme}://{bucket}/{node}":
            units.append(ListUnit(f"{scheme}://{bucket}/{node}", whole=False))
        pos = max(node + _LAST, key)


def _named(unit: ListUnit) -> tuple[str, str, str]:
    """The scheme, bucket and key prefix of an object store's ``unit``."""
    store = storage.store_for(unit.uri)
    bucket, _, prefix = store.path(unit.uri).partition("/")
    return store.scheme, bucket, prefix


def _list_paged_unit(pager: _Pager, fs: Any, unit: ListUnit, budget: int) -> _UnitListed:
    _, bucket, prefix = _named(unit)
    infos: list[dict[str, Any]] = []
    token = None
    while True:
        page = pager(fs, bucket, prefix, unit.after, min(_PAGE, budget - len(infos)), token)
        infos += page.infos
        if page.token is None:
            return _UnitListed(infos, [])
        if len(infos) >= budget:
            return _UnitListed(infos, _rest_of(pager, fs, unit, infos[-1]["name"][len(bucket) + 1 :]))
        token = page.token


def _list_whole_unit(fs: Any, unit: ListUnit) -> _UnitListed:
    """Another object store's class prefix, listed whole by its fsspec filesystem."""
    path = storage.store_for(unit.uri).path(unit.uri)
    return _UnitListed([info for _, info in sorted(fs.find(path, detail=True, withdirs=False).items())], [])


def list_units(
    units: list[ListUnit], *, root: str, label_depth: int, skip: Skip, budget: int
) -> list[StagedRow | ListUnit]:
    """List ``units`` in order until ``budget`` objects are listed; return their rows and the
    units left (those not started, and the rest of the one that reached the budget). Runs
    inside an executor."""
    root = storage.normalize(root)
    fs, root_path = storage.filesystem(root)
    out: list[StagedRow | ListUnit] = []
    listed = 0
    for n, unit in enumerate(units):
        if listed >= budget:
            out += units[n:]
            break
        try:
            if storage.is_local(root):
                found = _list_local_unit(root_path, unit, budget - listed)
            elif (pager := _PAGERS.get(storage.scheme(root))) is not None:
                found = _list_paged_unit(pager, fs, unit, budget - listed)
            else:
                found = _list_whole_unit(fs, unit)
        except Exception as exc:
            raise StorageError(f"cannot list {unit.uri}: {type(exc).__name__}: {exc}") from exc
        listed += len(found.infos)
        out += [_row(root, root_path, info, label_depth, skip) for info in found.infos]
        out += found.rest
        if not found.infos and not found.rest and unit.whole:
            log.warning("prefix %s holds no objects", unit.uri)
    return out


def _first_units(root: str, prefixes: Sequence[str]) -> list[ListUnit]:
    """One unit per class prefix (on S3 the prefix ends with '/': ``cat`` is not ``catfish``)."""
    s3 = not storage.is_local(root)
    return [ListUnit(p.rstrip("/") + "/" if s3 else p) for p in prefixes]


def list_lake(
    engine: Engine,
    root: str,
    prefixes: Sequence[str],
    *,
    label_depth: int = 1,
    skip: Skip = _NO_SKIP,
    task_objects: int = 100_000,
    stage: Callable[[Callable[[list[Any]], list[Any]]], Callable[[list[Any]], list[Any]]] | None = None,
) -> list[Any]:
    """Every object below the class ``prefixes`` (from :func:`jobs.manifest_steps.listing.discover`), as
    rows, listed in rounds of tasks that each list at most ``task_objects`` objects.

    ``stage`` wraps each round's task (the manifest job stages the rows on the worker and hands
    back a part instead); the result is then what the wrapped tasks return, the work left for
    the next round (``ListUnit``) aside."""
    task: Callable[[list[ListUnit]], list[Any]] = partial(
        list_units, root=storage.normalize(root), label_depth=label_depth, skip=skip, budget=task_objects
    )
    if stage is not None:
        task = stage(task)
    units = _first_units(root, prefixes)
    results: list[Any] = []
    rounds = tasks = 0
    while units:
        # Round 1: the class prefixes; later rounds: the pieces of large prefixes. At most a
        # few tasks per core (a task lists its units in turn, up to its budget).
        parts = min(len(units), 4 * engine.parallelism)
        out = engine.map_partitions(task, units, partitions=parts)
        results += [r for r in out if not isinstance(r, ListUnit)]
        units = sorted((u for u in out if isinstance(u, ListUnit)), key=ListUnit.sort_key)
        rounds, tasks = rounds + 1, tasks + parts
        if units:
            log.info("listing round %d done; %d pieces of large prefixes left", rounds, len(units))
    log.info("listed %d class prefixes in %d task(s), %d round(s)", len(prefixes), tasks, rounds)
    return results
