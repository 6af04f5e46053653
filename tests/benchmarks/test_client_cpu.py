"""benchmarks/client_cpu.py runs end to end, small: every store's client reads the object whole
in ranges (the bytes checked against the object's), and prints each one's CPU a read beside
S3's. (No test asserts a speed.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "client_cpu.py"

pytestmark = [pytest.mark.azure, pytest.mark.slow]


def test_a_small_run_reads_every_store_and_compares_it_with_s3(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--object-mib",
            "3",
            "--read-mib",
            "2",
            "--rounds",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["cpu_ms_per_read"]) == {"s3", "gcs", "azure"}
    assert all(len(r) == 2 and min(r) > 0 for r in result["rounds"].values()), result["rounds"]
    assert result["vs_s3"]["s3"] == 1.0
    for store in ("s3", "gcs", "azure"):
        assert any(line.split()[:1] == [store] for line in done.stdout.splitlines()), done.stdout


def test_an_unknown_store_is_refused_naming_it() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--stores", "s3,hdfs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "'s3,hdfs'" in done.stderr and "s3, gcs, azure" in done.stderr, done.stderr
