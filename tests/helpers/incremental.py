"""Issue 23's incremental manifests: a lake that grows between two manifests, and the checks that
a manifest built with ``--base`` is the one built from scratch (shared by the local, S3 and
engine tests)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from jobs import manifest as manifest_job
from jobs.common.engines import split_parts
from jobs.manifest_steps.config import ManifestConfig
from lakeshard import storage
from lakeshard.format import read_manifest_info
from lakeshard.format.manifest_table import iter_parts, read_channel
from tests.helpers.lake import encode, make_image

__all__ = [
    "CLASSES",
    "NOT_AN_IMAGE",
    "CountingEngine",
    "Growth",
    "assert_same_tables",
    "build",
    "channels",
    "grow",
    "write_lake_objects",
]

#: The lake before it grows: three classes of small PNGs (some a folder deeper) and one object
#: that is not an image (a reject of the header read, which ``--base`` reuses as such).
CLASSES = {"cat": 24, "dog": 20, "fox": 16}
NOT_AN_IMAGE = "dog/notes.png"


def _key(label: str, i: int) -> str:
    return f"{label}/{'deep/' if i % 3 == 0 else ''}img_{i:03d}.png"


def write_lake_objects(lake: str) -> list[str]:
    """Write the lake under ``lake`` (a local path or URI); return its keys."""
    keys = []
    for li, (label, n) in enumerate(CLASSES.items()):
        for i in range(n):
            storage.write_bytes_atomic(
                storage.join(lake, _key(label, i)), encode(make_image(li * 1000 + i), "PNG")
            )
            keys.append(_key(label, i))
    storage.write_bytes_atomic(storage.join(lake, NOT_AN_IMAGE), b"not a picture, a note about the dogs\n")
    return [*keys, NOT_AN_IMAGE]


@dataclass
class Growth:
    """What :func:`grow` did to the lake: the keys added, removed and rewritten."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)


def grow(lake: str, keys: list[str], *, added_per_class: int = 2) -> Growth:
    """Grow the lake by ``added_per_class`` images a class (10% of this lake with 2), remove
    three objects and rewrite one with other bytes (a new ETag; locally also a later mtime)."""
    g = Growth()
    for li, label in enumerate(CLASSES):
        for j in range(added_per_class):
            key = f"{label}/new_{j:02d}.png"
            storage.write_bytes_atomic(
                storage.join(lake, key), encode(make_image(50_000 + li * 100 + j), "PNG")
            )
            g.added.append(key)
    g.removed = [_key("cat", 4), _key("dog", 7), _key("fox", 9)]
    for key in g.removed:
        storage.remove(storage.join(lake, key))
    g.changed = [_key("fox", 2)]
    uri = storage.normalize(storage.join(lake, g.changed[0]))
    storage.write_bytes_atomic(uri, encode(make_image(99_999, size=(40, 36)), "PNG"))
    if uri.startswith("file://"):
        path = storage.filesystem(uri)[1]
        st = os.stat(path)
        os.utime(
            path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000)
        )  # a later mtime, whatever the clock
    return g


def build(engine: Any, lake: str, out: str, **opts: Any) -> dict[str, Any]:
    """Run the manifest job on ``engine``; return its summary."""
    cfg = ManifestConfig(
        input=lake,
        output=out,
        engine=engine.name,
        seed=5,
        max_reject_fraction=0.1,
        split={"train": 0.6, "validation": 0.2, "test": 0.2},
        rows_per_part=25,
        list_task_objects=16,
        **opts,
    )
    return manifest_job.run(cfg, engine)


def assert_same_tables(a: str, b: str) -> None:
    """``labels.json``, every manifest table part (row for row) and ``_manifest.json`` but for
    ``base`` are equal in the datasets at ``a`` and ``b``."""
    assert storage.read_json(storage.join(a, "labels.json")) == storage.read_json(
        storage.join(b, "labels.json")
    )
    ma, mb = (read_manifest_info(d) for d in (a, b))
    assert replace(ma, base=None) == replace(mb, base=None)
    for table in ("all", "rejects", *ma.split):
        parts_a, parts_b = list(iter_parts(a, table)), list(iter_parts(b, table))
        assert len(parts_a) == len(parts_b)
        for i, (x, y) in enumerate(zip(parts_a, parts_b, strict=True)):
            assert x.to_pylist() == y.to_pylist(), f"manifests/{table} part {i} differs"


def channels(root: str) -> dict[str, str]:
    """``{key: channel}`` of the accepted rows of the manifest at ``root``."""
    table: pa.Table = read_channel(root, "all", columns=["key", "channel", "status"])
    return {r["key"]: r["channel"] for r in table.to_pylist() if r["status"] == "ok"}


class CountingEngine:
    """A real engine, recording the task function of each action (``map_partitions`` call),
    and how many engine tasks it ran (``tasks``, by action name: one entry per action)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.actions = engine, []
        self.tasks: dict[str, list[int]] = {}
        self.name, self.parallelism, self.task_cpus = engine.name, engine.parallelism, engine.task_cpus

    def map_partitions(self, fn: Any, items: Any, *, partitions: int, cpu_bound: bool = False) -> list[Any]:
        fn_ = getattr(fn, "fn", getattr(fn, "func", fn))  # jobs.common.tasks.each, functools.partial
        name = getattr(fn_, "__name__", repr(fn_))
        self.actions.append(name)
        self.tasks.setdefault(name, []).append(len(split_parts(items, partitions)))
        return self.engine.map_partitions(fn, items, partitions=partitions, cpu_bound=cpu_bound)
