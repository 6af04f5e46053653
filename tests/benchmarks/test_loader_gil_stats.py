"""benchmarks/loader_gil.py --stats runs end to end: it streams under py-spy and prints each part's
share of the busy samples (the figure itself is measured by hand: docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_overhead_benchmark_prints_each_part_and_the_sum(tmp_path: Path):
    done = subprocess.run(
        [
            *(sys.executable, str(ROOT / "benchmarks" / "loader_gil.py"), "--stats"),
            *("--images", "256", "--seconds", "3", "--cache", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shares = [float(m) for m in re.findall(r"^\s*([0-9.]+)%", done.stdout, flags=re.M)]
    assert len(shares) == 4 and 0 < shares[-1] < 100, done.stdout + done.stderr[-3000:]
    assert shares[-1] == pytest.approx(sum(shares[:-1]), abs=0.002)
    assert re.search(r"streamed \d+ epochs", done.stdout)
