"""The loader benchmarks run end to end on a tiny dataset and write what they claim (their
figures are measured by hand; no test asserts a speed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # starts processes
def test_loader_bench_measures_every_ratio(tmp_path: Path):
    out = tmp_path / "loader.json"
    done = run(
        "benchmarks/loader_bench.py",
        "--images",
        "40",
        "--size",
        "32",
        "--repeats",
        "2",
        "--workdir",
        str(tmp_path),
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["images"] == 40
    for name in (
        "shardloader_vs_ceiling",
        "shardloader_next_epoch_vs_ceiling",
        "shardloader_vs_ceiling_paired",
        "shardloader_next_epoch_vs_ceiling_paired",
        "shardloader_vs_dataloader",
    ):
        assert math.isfinite(result["ratios"][name]) and result["ratios"][name] > 0, name
    assert len(result["runs"]["shardloader_next_epoch"]) == len(result["runs"]["dataloader_files"]) == 2
    assert len(result["runs"]["shardloader_new_loader_extra_s"]) == 2  # may be < 0 on a noisy machine
    assert all(math.isfinite(x) and abs(x) < 60 for x in result["runs"]["shardloader_new_loader_extra_s"])
    assert "loader and ceiling output: identical" in done.stderr


@pytest.mark.slow
def test_code_ab_loader_runs_each_variant_in_its_own_processes(tmp_path: Path):
    out = tmp_path / "ab.json"
    done = run(
        "benchmarks/code_ab.py",
        "--loader",
        "--images",
        "40",
        "--size",
        "32",
        "--rounds",
        "2",
        "--epochs",
        "3",
        "--cache",
        str(tmp_path),
        "--out",
        str(out),
        "",
        "num_threads=1,prefetch=2",
    )
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"", "num_threads=1,prefetch=2"}
    for per_process in runs.values():
        assert len(per_process) == 2
        assert all(len(r["epochs"]) == 3 and all(x > 0 for x in r["epochs"]) for r in per_process)
    assert "(defaults)" in done.stdout

    bad = run("benchmarks/code_ab.py", "--loader", "--cache", str(tmp_path), "threads=2")
    assert bad.returncode == 2
    assert "'threads' in variant 'threads=2' is not a ShardLoader option" in bad.stderr


#: Files of the loader's own that a loader process holds the GIL in (the ceiling runs none but decode.py).
_LOADER_LINES = ("decode.py", "batch.py", "_internal/", "shard_loader.py", "stats.py")


@pytest.mark.slow
def test_loader_gil_samples_the_loader_and_the_ceiling_each_in_its_own_process(tmp_path: Path):
    out = tmp_path / "gil.json"
    done = run(
        "benchmarks/loader_gil.py",
        "--images",
        "40",
        "--size",
        "32",
        "--seconds",
        "2",
        "--warmup",
        "2",
        "--repeats",
        "1",
        "--cache",
        str(tmp_path),
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    (loader,), (ceiling,) = runs["loader"], runs["ceiling"]
    for r in (loader, ceiling):
        assert r["images_per_s"] > 0 and 0 < r["gil_share"] <= 1 and r["gil_us_per_image"] > 0
    # Each was sampled in the right process: the loader's decode calls, the ceiling's own.
    # The loader's process: its own lines (the decode call is a few of its samples, and a busy
    # machine's 2 s drew none of them in CI); the ceiling runs none of the loader's batches.
    assert any(f"loaders/{m}" in line for line in loader["lines_us_per_image"] for m in _LOADER_LINES)
    assert any("loader_bench.py" in line for line in ceiling["lines_us_per_image"])
    assert not any("loaders/batch.py" in line for line in ceiling["lines_us_per_image"])
    assert "GIL us/image" in done.stdout


def test_loader_gil_counts_the_images_done_while_sampled():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from loader_gil import images_between

    passes = [(10.0, 0), (11.0, 100), (12.0, 300)]  # wall clock, images done
    assert images_between(passes, 10.5, 11.5) == 200 - 50  # 100 + half of 200, minus half of 100
    assert images_between(passes, 10.0, 12.0) == 300
    with pytest.raises(ValueError, match="outside the passes"):
        images_between(passes, 9.0, 11.0)
