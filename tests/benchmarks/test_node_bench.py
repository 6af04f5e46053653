"""The node benchmark (benchmarks/node_bench.py) runs end to end in its --small mode on the CPU:
every step reports, the one that needs CUDA says why it did not run, and torchrun with one
process joins a process group (gloo here, nccl on a GPU). (No test asserts a speed.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import run_json_tool

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_small_node_benchmark_runs_every_step(tmp_path: Path):
    out = tmp_path / "node.json"
    command = [
        sys.executable,
        "benchmarks/node_bench.py",
        "--small",
        "--workdir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    stdout, result = run_json_tool(command, out, cwd=ROOT)
    assert [(r["ranks"], r["threads"]) for r in result["scaling"]] == [(1, 1), (1, 2), (2, 1)]
    for row in result["scaling"]:
        assert row["images_per_s"] > 0 and row["ceiling_images_per_s"] > 0 and row["cpu_s_per_image"] > 0
    model = result["model"]
    assert model["device"] == "cpu" and model["fed_images_per_s"] > 0 and model["ceiling_images_per_s"] > 0
    assert 0 <= model["data_wait_share"] <= 1
    assert result["torchrun"] == {**result["torchrun"], "exit": 0, "backend": "gloo", "metrics_written": True}
    gpu = result["gpu_decode"]
    assert gpu["encoded_only"]["images_per_s"] > 0
    assert gpu["skipped"] == "CUDA is not available"
    assert "GPU decoding: not run: CUDA is not available" in stdout


@pytest.mark.slow  # four processes that import torch
def test_bad_arguments_are_one_line(tmp_path: Path):
    for args, message in [
        (["--threads", "1,x"], "'1,x': comma-separated positive integers"),
        (["--threads", "0"], "'0': comma-separated positive integers"),
        (["--seconds", "0"], "--seconds must be positive, got 0.0"),
        (["--images", "0"], "--images must be at least 1, got 0"),
    ]:
        proc = subprocess.run(
            [sys.executable, "benchmarks/node_bench.py", "--workdir", str(tmp_path / "w"), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "w").exists()
