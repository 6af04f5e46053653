"""The shard job's dry run (``--plan-only``): the plan through the engine, its summary, nothing
written. The summary is checked against the reference plan
(:func:`tests.helpers.reference_plan.make_plan`) on the manifest's rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.plan_summary import PlanSummary
from lakeshard import storage
from lakeshard.format.manifest_table import read_channel
from tests.helpers.lake import write_lake
from tests.helpers.reference_plan import make_plan

REPO = Path(__file__).resolve().parents[3]


def _files(root: Path) -> dict[str, int | None]:
    """Every file (with its modification time) and folder under ``root``."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns if p.is_file() else None for p in root.rglob("*")}


def _manifest(tmp_path: Path, local_engine) -> Path:
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 31, "b": 17, "c": 9, "d": 4})
    out = tmp_path / "ds"
    manifest_job.run(
        ManifestConfig(input=str(lake), output=str(out), split="train=0.75,validation=0.25"), local_engine
    )
    return out


def _reference(out: Path, channel: str, *, num_shards: int, seed: int, remainder: str) -> dict[str, object]:
    """What make_plan on the manifest's rows says the summary holds."""
    rows = read_channel(storage.normalize(str(out)), channel)
    rows = rows.take(pc.sort_indices(rows, sort_keys=[("key", "ascending")]))
    labels = np.asarray(rows["label_index"].to_pylist())
    plan = make_plan(
        rows["key"].to_pylist(),
        labels.tolist(),
        num_shards=num_shards,
        seed=seed,
        channel=channel,
        remainder=remainder,
    )
    spreads = [
        np.bincount(plan.shard[labels[plan.source] == c], minlength=num_shards) for c in np.unique(labels)
    ]
    uris = rows["uri"].to_pylist()
    return {
        "rows": rows.num_rows,
        "classes": len(spreads),
        "rows_per_shard": plan.rows_per_shard,
        "dropped": len(plan.dropped),
        "padded": len(plan.padded),
        "spread": max(int(s.max() - s.min()) for s in spreads),
        "uneven_classes": sum(int(s.max() - s.min()) == 1 for s in spreads),
        "named": sorted(
            [("dropped", uris[i]) for i in plan.dropped] + [("padded", uris[i]) for i in plan.padded]
        ),
    }


@pytest.mark.parametrize("engine_name", ["local_engine", "spark_engine"])
def test_plan_only_summarises_make_plans_plan_and_writes_nothing(
    tmp_path: Path, local_engine, engine_name: str, request: pytest.FixtureRequest
) -> None:
    out = _manifest(tmp_path, local_engine)
    engine = request.getfixturevalue(engine_name)
    before = _files(out)
    for remainder, num_shards in (("drop", 4), ("pad", 3)):
        summary = shard_job.run(
            ShardConfig(dataset=str(out), num_shards=num_shards, remainder=remainder, plan_only=True), engine
        )
        assert isinstance(summary, PlanSummary)
        assert [c.channel for c in summary.channels] == ["train", "validation"]
        for c in summary.channels:
            want = _reference(out, c.channel, num_shards=num_shards, seed=0, remainder=remainder)
            got = {
                "rows": c.rows,
                "classes": c.classes,
                "rows_per_shard": c.rows_per_shard,
                "dropped": c.dropped,
                "padded": c.padded,
                "spread": c.spread,
                "uneven_classes": c.uneven_classes,
                "named": sorted(c.named),
            }
            assert got == want, (remainder, c.channel)
            assert c.num_shards == num_shards
        # No image read, no shard, no dataset.json, no staging left: the dataset folder is as it was.
        assert _files(out) == before


def test_plan_only_plans_what_the_job_then_writes(tmp_path: Path, local_engine) -> None:
    out = _manifest(tmp_path, local_engine)
    cfg = {"dataset": str(out), "num_shards": 3, "image_size": 16}
    summary = shard_job.run(ShardConfig(**cfg, plan_only=True), local_engine)
    info = shard_job.run(ShardConfig(**cfg), local_engine)
    assert {c.channel: (c.rows_per_shard, c.dropped) for c in summary.channels} == {
        c: (e.rows_per_shard, len(e.dropped)) for c, e in info.channels.items()
    }


def _shard_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "jobs.shard", "--engine", "local", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plan_only_cli_prints_the_plan_and_exits_0(tmp_path: Path, local_engine) -> None:
    out = _manifest(tmp_path, local_engine)
    before = _files(out)
    done = _shard_cli("--dataset", str(out), "--num-shards", "4", "--plan-only")
    assert done.returncode == 0, done.stderr[-3000:]
    want = _reference(out, "train", num_shards=4, seed=0, remainder="drop")
    assert (
        f"train: {want['rows']} rows in 4 classes -> 4 shards × {want['rows_per_shard']} rows" in done.stdout
    )
    assert f"{want['dropped']} dropped, 0 padded" in done.stdout
    assert _files(out) == before
    # The checks still run first: a bad dataset is one error line, exit 2.
    bad = _shard_cli("--dataset", str(tmp_path / "nowhere"), "--num-shards", "4", "--plan-only")
    assert bad.returncode == 2 and bad.stderr.startswith("jobs/shard.py: error: ") and "nowhere" in bad.stderr
