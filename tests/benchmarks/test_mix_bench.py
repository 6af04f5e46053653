"""The mixture benchmark (benchmarks/mix_bench.py) runs end to end in its --small mode: both
variants report a rate, and the mixture of A and B delivers an epoch of the same images (and
labels) as the single dataset C that holds them. (No test asserts a speed.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import run_json_tool

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # builds three datasets and streams ~6,000 images
def test_the_small_mix_benchmark_runs_both_variants(tmp_path: Path):
    out = tmp_path / "mix.json"
    command = [
        sys.executable,
        "benchmarks/mix_bench.py",
        "--small",
        "--workdir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    stdout, result = run_json_tool(command, out, cwd=ROOT)
    data = result["datasets"]
    assert data["A"]["rows"] + data["B"]["rows"] == data["C"]["rows"] == 1024
    assert len({d["dataset_version"] for d in data.values()}) == 3
    summary = result["summary"]
    for variant in ("single", "mix"):
        assert summary[variant]["images_per_s_median"] > 0
        assert summary[variant]["cpu_ms_per_image_median"] > 0
        assert summary[variant]["images_per_epoch"] == 1024
    assert summary["same_count_per_epoch"] and summary["same_labels_per_epoch"]
    assert summary["same_images_epoch0"]  # image by image: A and B mixed are C
    assert sorted(r["variant"] for r in result["runs"]) == ["mix", "single"]
    for run in result["runs"]:
        assert [e["images"] for e in run["epochs"]] == [1024] * result["config"]["epochs"]
        if run["variant"] == "mix":
            assert all(e["source_rows"] == [data["A"]["rows"], data["B"]["rows"]] for e in run["epochs"])
    assert "images/s" in stdout and "mix is" in stdout


@pytest.mark.slow  # three processes that import torch
def test_bad_arguments_are_one_line(tmp_path: Path):
    for args, message in [
        (["--images", "1000"], "--images (1000) must be a multiple of --batch-size (64)"),
        (["--split", "1"], "'1': must be strictly between 0 and 1"),
        (["--repeats", "0"], "'0': must be at least 1"),
    ]:
        proc = subprocess.run(
            [sys.executable, "benchmarks/mix_bench.py", "--workdir", str(tmp_path / "w"), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("mix_bench.py: error:")
        assert not (tmp_path / "w").exists()
