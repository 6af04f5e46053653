"""benchmarks/prep_bench.py runs end to end on a tiny dataset: both variants stream, the ratio and
the bytes per image are reported (the figures are measured by hand: docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_preparation_benchmark_runs_both_variants(tmp_path: Path):
    out = tmp_path / "prep.json"
    cmd = [sys.executable, "benchmarks/prep_bench.py", "--images", "64", "--size", "64", "--batch-size", "16"]
    done = subprocess.run(
        [*cmd, "--repeats", "1", "--out", str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(rate > 0 for rates in result["images_per_s"].values() for rate in rates)
    assert result["ratio_prep_vs_local"] > 0
    sent, back = result["bytes_per_image"]["to_worker"], result["bytes_per_image"]["to_trainer"]
    assert back > 64 * 64 * 3 > sent > 0  # the decoded image comes back; its JPEG went out
    assert "prep / local" in done.stdout
    assert result["doctor_local"]["bottleneck"] in ("store", "decode", "transform", "model")
