"""benchmarks/incremental_bench.py at a tiny scale on the local engine: the lakes it makes, the
builds it times and what it writes. Nothing here asserts a speed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import incremental_bench  # noqa: E402 - benchmarks/ is not a package


@pytest.mark.slow
@pytest.mark.parametrize("store", ["local", "near"])
def test_the_bench_times_both_builds_of_the_grown_lake(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On local disk, and with the lake read from the remote-like S3 store (nginx + shim)."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(
            name, os.environ.get(name, "")
        )  # the bench points them at its store: restored after
    out = tmp_path / "r.json"
    assert (
        incremental_bench.main(
            [
                "--images",
                "60",
                "--engine",
                "local",
                "--repeats",
                "2",
                "--num-shards",
                "2",
                "--split",
                "train=1",
                "--cache",
                str(tmp_path / "cache"),
                "--work",
                str(tmp_path / "w"),
                "--store",
                store,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["store"] == store and result["manifest_base"]
    lake = result["lake"]
    assert (lake["v1_objects"], lake["added"], lake["removed"], lake["v2_objects"]) == (60, 6, 5, 61)
    assert len(list((tmp_path / "w" / "store" / "lake").rglob("*.jpg"))) == 61
    assert 30 < lake["jpeg_kb_median"] < 200
    (engine,) = result["engines"]
    scratch, incremental = engine["runs"]["scratch"], engine["runs"]["incremental"]
    assert len(scratch) == len(incremental) == 2
    for s, i in zip(scratch, incremental, strict=True):
        assert s["reused"] == 0 and i["reused"] > 0
        assert i["reused"] + i["decoded"] == s["decoded"]
        # The new and changed objects, and those of A's rows its plan dropped (not in its shards) still there.
        assert (
            lake["added"] + lake["changed"]
            <= i["decoded"]
            <= lake["added"] + lake["changed"] + engine["base_build"]["dropped"]
        )
    assert (
        engine["ratio"] == engine["median"]["incremental"]["total_s"] / engine["median"]["scratch"]["total_s"]
    )
    assert len(result["load_before"]) == 3


@pytest.mark.slow
def test_only_incremental_times_no_scratch_build(tmp_path: Path) -> None:
    """``--only incremental``: the base build and the incremental builds, no scratch build and so no ratio."""
    out = tmp_path / "r.json"
    assert (
        incremental_bench.main(
            [
                "--images",
                "60",
                "--engine",
                "local",
                "--repeats",
                "3",
                "--num-shards",
                "2",
                "--split",
                "train=1",
                "--only",
                "incremental",
                "--cache",
                str(tmp_path / "cache"),
                "--work",
                str(tmp_path / "w"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (engine,) = json.loads(out.read_text())["engines"]
    assert list(engine["runs"]) == ["incremental"] and len(engine["runs"]["incremental"]) == 3
    assert all(r["reused"] > 0 for r in engine["runs"]["incremental"])
    assert engine["ratio"] is None and engine["shard_ratio"] is None
    assert engine["base_build"]["reused"] == 0
