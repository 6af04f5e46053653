"""benchmarks/same_batches.py tells the loader's batches apart between two versions of the code:
the same code is "same" (exit 0), and a copy whose shuffle is seeded otherwise is "DIFFERENT"
(exit 1, naming the case and the first batch that differs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp_path: Path) -> Path:
    """A copy of HEAD (what the tool compares against) with the built C extensions."""
    copy = tmp_path / "copy"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(copy), "HEAD"], cwd=ROOT, check=True)
    for built in (ROOT / "loaders").glob("_*.so"):
        (copy / "loaders" / built.name).write_bytes(built.read_bytes())
    return copy


def _same_batches(tree: Path, *cases: str) -> subprocess.CompletedProcess[str]:
    only = [arg for case in cases for arg in ("--only", case)]
    return subprocess.run(
        [sys.executable, "benchmarks/same_batches.py", "--ref", "HEAD", "--tree", str(tree), *only],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow  # two versions of the code, four fresh processes, a remote-like store
def test_same_code_is_same_and_another_shuffle_is_named(tmp_path: Path):
    copy = _checkout(tmp_path)
    try:
        same = _same_batches(copy, "plain", "shuffle-2ranks")
        assert same.returncode == 0, same.stdout + same.stderr
        assert "2 of 2 cases the same as HEAD" in same.stdout
        shuffle = copy / "loaders" / "_internal" / "shuffle.py"
        text = shuffle.read_text()
        assert "SeedSequence([seed, epoch, rank])" in text
        shuffle.write_text(
            text.replace("SeedSequence([seed, epoch, rank])", "SeedSequence([seed, rank, epoch])")
        )
        changed = _same_batches(copy, "plain", "shuffle-2ranks")
        assert changed.returncode == 1, changed.stdout + changed.stderr
        lines = changed.stdout.splitlines()
        assert any(line.startswith("plain ") and " same:" in line for line in lines), changed.stdout
        assert any(line.startswith("shuffle-2ranks ") and "DIFFERENT" in line for line in lines), (
            changed.stdout
        )
        # epoch 1 on rank 0 is the first place the orders part ([7, 0, 0] either way in epoch 0)
        assert "shuffle-2ranks run.rank0.epochs[1][0]: ref '" in changed.stdout
        assert "1 of 2 cases the same as HEAD" in changed.stdout
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(copy)], cwd=ROOT, check=False)
