"""The shard job's commit: the new shards become the dataset when ``dataset.json``, written
last, names them. A reader sees the old dataset, no dataset, or the new one, never a part
(readers trust a dataset only once ``dataset.json`` is there, and open the files it names).

Locally the staged shards are renamed into ``shards/`` (the old ones removed first). On S3,
which has no rename, nothing is copied: the staging folder is the version folder
``shards/v=<version>/`` the shards were written into once (:mod:`jobs.shard_steps.staging`); the commit
removes what is not a shard, marks the version complete and writes ``dataset.json``. Earlier
versions stay until ``python -m jobs.versions remove`` removes them.
"""

from __future__ import annotations

from jobs.shard_steps.dataset_info import BuiltChannel
from jobs.shard_steps.preprocess import SegmentTask
from jobs.shard_steps.staging import staged_shard, staging_root, versioned, work_uri
from lakeshard import locks, storage
from lakeshard.errors import ShardError
from lakeshard.format import (
    VERSION_MARKER,
    DatasetInfo,
    dataset_json_uri,
    shard_rejects_uri,
    shard_relpath,
    shards_uri,
)

__all__ = ["commit", "place_assembled", "staged_rejects"]


def place_assembled(
    root: str, staging: str, final: dict[tuple[str, int], str], tasks: list[SegmentTask], *, num_shards: int
) -> dict[tuple[str, int], str]:
    """Put each shard assembled beside in its place; a segment file it replaces loses its
    receipt (which no longer vouches for it). Locally that is a rename onto its place in the
    staging folder; on S3 the shard stays where it was written and the segment file at its
    place is deleted. Returns each shard's path, relative to the dataset root ``root``, once
    committed (what ``dataset.json`` names)."""
    places = {key: staged_shard(staging, key[0], key[1], num_shards) for key in final}
    moves = {final[key]: place for key, place in places.items() if final[key] != place}
    replaced = set(moves.values())
    for task in tasks:
        if task.uri in replaced and task.receipt is not None:
            storage.remove(task.receipt)
    if versioned(staging):
        for place in replaced:
            storage.remove(place)
        prefix = storage.normalize(root) + "/"
        return {key: uri.removeprefix(prefix) for key, uri in final.items()}
    for uri, target in moves.items():
        storage.replace(uri, target)
    return {(channel, shard): shard_relpath(channel, shard, num_shards) for channel, shard in final}


def _check_counts(channels: list[BuiltChannel], num_shards: int) -> None:
    """The invariant, counted: exactly ``num_shards`` files of equal size per channel."""
    for channel in channels:
        got = sorted((s.index, s.stats["rows"]) for s in channel.shards)
        want = [(i, channel.deal.rows_per_shard) for i in range(num_shards)]
        if got != want:
            raise ShardError(
                f"channel {channel.name!r}: wrote shards {got}, planned {want}; nothing was committed"
            )


def _remove_strays(staging: str, keep: set[str]) -> None:
    """Delete every file in ``staging`` but the shards ``keep`` names (paths below it): what a
    killed run assembled for a plan this run did not make."""
    fs, path = storage.filesystem(staging)
    try:
        found = fs.find(path)
    except FileNotFoundError:
        return
    strays = [f for f in found if f[len(path) + 1 :] not in keep]
    if strays:
        fs.rm(strays)


def staged_rejects(staging: str) -> str:
    """The folder below which a worker writes the shard rejects table of a local build before the
    commit (:func:`~lakeshard.format.shard_rejects_uri` of it); on S3 it writes it straight into
    the version folder (``dataset.json``'s ``rejects_path``)."""
    return work_uri(staging, "table")


def commit(root: str, staging: str, channels: list[BuiltChannel], info: DatasetInfo) -> None:
    """Check the staged shards (``channels``), then locally: invalidate the old dataset, put the shard rejects
    table a worker wrote and the new shards in place, and last ``dataset.json`` (``info``). On S3
    the shards and the rejects table are in place in the version folder: mark the version
    complete, and last ``dataset.json``, which replaces the old one in one PUT (a reader sees the
    old dataset or the new one, never none)."""
    _check_counts(channels, info.num_shards)
    if not versioned(root):
        storage.remove(dataset_json_uri(root))
        storage.replace(shard_rejects_uri(staged_rejects(staging)), storage.join(root, info.rejects_path))
    storage.remove(work_uri(staging), recursive=True)
    storage.remove_temporaries(staging)  # a killed client's tasks may still have been writing
    # a shard's path below the staging folder (its channel folder and file name), and on S3 the
    # rejects table beside them
    keep = {"/".join(s.path.split("/")[-2:]) for c in info.channels.values() for s in c.shards}
    if versioned(root):
        keep.add(info.rejects_path.rsplit("/", 1)[-1])
    _remove_strays(staging, keep)
    if not versioned(root):
        storage.remove(shards_uri(root), recursive=True)
        storage.move(staging, shards_uri(root))
        storage.remove(staging_root(root), recursive=True)
    else:  # the old dataset.json stays until the new one replaces it (one PUT)
        storage.write_json_atomic(storage.join(staging, VERSION_MARKER), info.to_json())
    locks.confirm(root)  # a build whose lock was taken over commits nothing
    storage.write_json_atomic(dataset_json_uri(root), info.to_json())
