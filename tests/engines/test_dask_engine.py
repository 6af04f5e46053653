"""The Dask engine's operations, one by one, on a LocalCluster of worker processes."""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
import pytest

from jobs.errors import ManifestError, ShardError
from jobs.shards import PLAN_SCHEMA

pytestmark = pytest.mark.dask

_SCHEMA = pa.schema([("uri", pa.string()), ("image", pa.binary()), ("status", pa.string())])


def _double(items: list[int]) -> list[int]:
    return [2 * i for i in items]


def _sizes(items: list[int]) -> list[int]:
    return [len(items)]


def _boom(items: list[int]) -> list[int]:
    if 3 in items:
        raise ManifestError("cannot list file:///lake/cat: boom on 3")
    return items


def _stage(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A stand-in for preprocessing: the image is binary that is not UTF-8 (the pandas trap)."""
    uris = batch.column("uri").to_pylist()
    return pa.RecordBatch.from_pylist(
        [{"uri": u, "image": b"\xff\xd8" + u.encode(), "status": "rejected" if u.endswith("bad") else "ok"}
         for u in uris], schema=_SCHEMA)


def _collect_part(part: int, records) -> dict[str, Any]:
    got = list(records)
    return {"part": part, "keys": [k for k, _ in got], "rows": [(r["uri"], r["image"], r["is_pad"]) for _, r in got]}


def test_map_partitions_runs_every_item_once(dask_engine) -> None:
    items = list(range(23))
    assert sorted(dask_engine.map_partitions(_double, items, partitions=4)) == [2 * i for i in items]
    assert sorted(dask_engine.map_partitions(_sizes, items, partitions=4)) == [5, 6, 6, 6]
    # More partitions than items: one item per task, none empty.
    assert dask_engine.map_partitions(_sizes, items[:3], partitions=50) == [1, 1, 1]
    assert dask_engine.map_partitions(_double, [], partitions=4) == []


def test_map_partitions_reraises_the_worker_error(dask_engine) -> None:
    with pytest.raises(ManifestError, match="boom on 3"):
        dask_engine.map_partitions(_boom, list(range(10)), partitions=5)


def test_parallelism_counts_worker_threads(dask_engine) -> None:
    assert dask_engine.parallelism == 2


def test_write_shards_routes_exactly_by_plan(dask_engine) -> None:
    uris = [f"s3://b/raw/c/{i:02d}.png" for i in range(12)] + ["s3://b/raw/c/zz-bad"]
    staged = dask_engine.preprocess(pa.table({"uri": uris}), _stage, _SCHEMA, partitions=5)
    try:
        meta = dask_engine.collect(staged, ["uri", "status"])
        assert sorted(meta["uri"].to_pylist()) == sorted(uris)
        assert meta.filter(pa.compute.equal(meta["status"], "rejected"))["uri"].to_pylist() == [uris[-1]]
        # 4 partitions of 3 rows, positions reversed against input order; row 0 also padded into part 3.
        plan = [(u, i % 4, 2 - i // 4 if i // 4 < 3 else 0, False) for i, u in enumerate(uris[:12])]
        plan = [(u, p, pos, pad) for u, p, pos, pad in plan if not (p == 3 and pos == 0)] + [(uris[0], 3, 0, True)]
        table = pa.table(list(zip(*plan, strict=True)), schema=PLAN_SCHEMA)
        stats = dask_engine.write_shards(staged, table, _collect_part, num_parts=4)
    finally:
        dask_engine.release(staged)
    assert sorted(s["part"] for s in stats) == [0, 1, 2, 3]
    by_part = {s["part"]: s for s in stats}
    for part, s in by_part.items():
        assert s["keys"] == [(part, pos) for pos in range(3)]  # sorted by position, nothing else
        want = sorted((pos, u) for u, p, pos, _ in plan if p == part)
        assert [u for u, _, _ in s["rows"]] == [u for _, u in want]
        assert all(img == b"\xff\xd8" + u.encode() and isinstance(img, bytes) for u, img, _ in s["rows"])
    assert [r for r in by_part[3]["rows"] if r[2]] == [(uris[0], b"\xff\xd8" + uris[0].encode(), True)]


def test_write_shards_refuses_a_plan_naming_unstaged_or_rejected_rows(dask_engine) -> None:
    staged = dask_engine.preprocess(pa.table({"uri": ["a", "b", "c-bad"]}), _stage, _SCHEMA, partitions=2)
    try:
        plan = pa.table({"uri": ["a", "nope"], "part": [0, 0], "position": [0, 1], "is_pad": [False, False]},
                        schema=PLAN_SCHEMA)
        with pytest.raises(ShardError, match=r"never staged.*nope"):
            dask_engine.write_shards(staged, plan, _collect_part, num_parts=1)
        plan = pa.table({"uri": ["c-bad"], "part": [0], "position": [0], "is_pad": [False]}, schema=PLAN_SCHEMA)
        with pytest.raises(ShardError, match=r"rejected rows.*c-bad"):
            dask_engine.write_shards(staged, plan, _collect_part, num_parts=1)
    finally:
        dask_engine.release(staged)


def test_an_empty_partition_is_still_written(dask_engine) -> None:
    staged = dask_engine.preprocess(pa.table({"uri": ["a", "b"]}), _stage, _SCHEMA, partitions=2)
    try:
        plan = pa.table({"uri": ["a", "b"], "part": [0, 0], "position": [1, 0], "is_pad": [False, False]},
                        schema=PLAN_SCHEMA)
        stats = dask_engine.write_shards(staged, plan, _collect_part, num_parts=2)
    finally:
        dask_engine.release(staged)
    assert sorted((s["part"], [u for u, _, _ in s["rows"]]) for s in stats) == [(0, ["b", "a"]), (1, [])]


def test_a_handed_client_is_not_closed(dask_client) -> None:
    from jobs.engines.dask_engine import DaskEngine

    DaskEngine(client=dask_client).close()
    assert dask_client.status == "running"


@pytest.mark.slow
def test_an_owned_local_cluster_is_closed() -> None:
    from jobs.engines.dask_engine import DaskEngine

    engine = DaskEngine(n_workers=1)
    try:
        assert engine.parallelism == 1
        assert engine.map_partitions(_double, [1, 2], partitions=2) == [2, 4]
    finally:
        engine.close()
    assert engine.client.status == "closed"


def test_an_unreachable_scheduler_is_a_clear_error(monkeypatch) -> None:
    from jobs.engines.dask_engine import DaskEngine
    from jobs.errors import EngineError
    from tests.helpers.procs import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EngineError, match=f"cannot connect to the dask scheduler at '{address}'"):
        DaskEngine(scheduler=address, connect_timeout=2)
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_staged_chunks_survive_a_lost_worker(dask_engine, dask_client) -> None:
    uris = [f"u{i:02d}" for i in range(20)]
    staged = dask_engine.preprocess(pa.table({"uri": uris}), _stage, _SCHEMA, partitions=6)
    try:
        holders = {w for ws in dask_client.who_has(staged.chunks).values() for w in ws}
        dask_client.restart_workers([sorted(holders)[0]])  # its staged chunks are gone with it
        plan = pa.table({"uri": uris, "part": [i % 2 for i in range(20)], "position": [i // 2 for i in range(20)],
                         "is_pad": [False] * 20}, schema=PLAN_SCHEMA)
        stats = dask_engine.write_shards(staged, plan, _collect_part, num_parts=2)
    finally:
        dask_engine.release(staged)
    assert sorted((s["part"], [u for u, _, _ in s["rows"]]) for s in stats) == [(0, uris[0::2]), (1, uris[1::2])]
