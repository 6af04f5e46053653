"""benchmarks/range_reads.py runs end to end in --small mode: the loader's own reads and every
library variant whose package is installed, each returning the file's bytes; a variant whose
package is missing is reported, never skipped silently. (No test asserts a speed.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import range_reads  # noqa: E402 - benchmarks/ is not a package


@pytest.mark.slow
def test_small_run_reads_the_same_bytes_through_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "rr.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "range_reads.py"), "--small", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "lakeshard" in result["ran"]
    # Every variant ran, or is named as missing or failed, with why, in the JSON and the output.
    assert set(result["ran"]) | set(result["missing"]) | set(result["failed"]) == set(range_reads.VARIANTS)
    for name in [*result["missing"], *result["failed"]]:
        assert f"{name}" in done.stdout and "NOT RUN" in done.stdout
    digests = result["row_group_digests"]
    assert digests["lakeshard"] and all(d == digests["lakeshard"] for d in digests.values())
    assert result["same_bytes"] is True


def test_a_missing_package_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    real = range_reads.importlib.util.find_spec
    monkeypatch.setattr(
        range_reads.importlib.util, "find_spec", lambda name: None if name == "opendal" else real(name)
    )
    missing = range_reads.missing_variants(list(range_reads.VARIANTS))
    # opendal's variants at least (obstore's too where obstore is not installed, as in CI)
    assert {"opendal-async", "fetcher+opendal"} <= set(missing)
    assert all("not installed" in why for why in missing.values())
    assert all("opendal" in missing[v] for v in ("opendal-async", "fetcher+opendal"))
