"""The loader benchmarks run end to end on a tiny dataset and write what they claim (their
figures are measured by hand; no test asserts a speed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_loader_bench_measures_every_ratio(tmp_path: Path):
    out = tmp_path / "loader.json"
    done = run("benchmarks/loader_bench.py", "--images", "40", "--size", "32", "--repeats", "2",
               "--workdir", str(tmp_path), "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["images"] == 40
    for name in ("shardloader_vs_ceiling", "shardloader_next_epoch_vs_ceiling", "shardloader_vs_ceiling_paired",
                 "shardloader_next_epoch_vs_ceiling_paired", "shardloader_vs_dataloader"):  # fmt: skip
        assert math.isfinite(result["ratios"][name]) and result["ratios"][name] > 0, name
    assert len(result["runs"]["shardloader_next_epoch"]) == len(result["runs"]["dataloader_files"]) == 2
    assert len(result["runs"]["shardloader_new_loader_extra_s"]) == 2  # may be < 0 on a noisy machine
    assert all(math.isfinite(x) and abs(x) < 60 for x in result["runs"]["shardloader_new_loader_extra_s"])
    assert "loader and ceiling output: identical" in done.stderr


def test_loader_ab_runs_each_variant_in_its_own_processes(tmp_path: Path):
    out = tmp_path / "ab.json"
    done = run("benchmarks/loader_ab.py", "--images", "40", "--size", "32", "--rounds", "2", "--epochs", "3",
               "--cache", str(tmp_path), "--out", str(out), "", "num_threads=1,prefetch=2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"", "num_threads=1,prefetch=2"}
    for per_process in runs.values():
        assert len(per_process) == 2
        assert all(len(r["epochs"]) == 3 and all(x > 0 for x in r["epochs"]) for r in per_process)
    assert "(defaults)" in done.stdout

    bad = run("benchmarks/loader_ab.py", "--cache", str(tmp_path), "threads=2")
    assert bad.returncode == 2
    assert "'threads' in variant 'threads=2' is not a ShardLoader option" in bad.stderr
