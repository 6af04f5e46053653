"""A local dataset on a read-only filesystem (a real read-only bind mount; root ignores file
modes, a mount it cannot write through): a build and the manifest job fail with one ``error:``
line and exit 2; ``--plan-only``, which only reads, works (its plan's files in a temporary
folder, with a warning). Real job processes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.helpers import one_error_line, run_local_job
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.slow]


@pytest.fixture()
def read_only(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``(src, ro)``: ``ro`` shows ``src`` through a read-only bind mount (unmounted at the end)."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {mounted.stderr.strip()}")
    try:
        made_ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, text=True)
        if made_ro.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount here: {made_ro.stderr.strip()}")
        yield src, ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_jobs_on_a_read_only_dataset_say_so_in_one_line_and_plan_only_works(
    tmp_path: Path, read_only: tuple[Path, Path]
):
    src, ro = read_only
    lake = tmp_path / "raw"
    write_lake(lake, {"cat": 6, "dog": 6}, size=(12, 10))
    # written through the writable side, before the test reads it through the read-only one
    ds_src = src / "ds"
    made = run_local_job(
        "jobs.manifest", "--input", str(lake), "--output", str(ds_src), "--split", "train=1.0"
    )
    assert made.returncode == 0, made.stderr
    with pytest.raises(OSError):  # the mount is really read-only, for root too
        (ro / "ds" / "probe").write_bytes(b"x")
    ds = ro / "ds"
    shard = ("jobs.shard", "--dataset", str(ds), "--num-shards", "2", "--image-size", "8")

    line = one_error_line(run_local_job(*shard, "--overwrite"), "jobs/shard.py")
    assert f"file://{ds} cannot be written (Read-only file system: " in line

    line = one_error_line(
        run_local_job(
            "jobs.manifest", "--input", str(lake), "--output", str(ro / "newds"), "--split", "train=1.0"
        ),
        "jobs/manifest.py",
    )
    assert f"file://{ro / 'newds'} cannot be written (Read-only file system: " in line

    planned = run_local_job(*shard, "--plan-only")
    assert planned.returncode == 0, planned.stderr
    assert "Traceback" not in planned.stderr
    assert "cannot be written: the plan's files go to this machine's temporary folder" in planned.stderr
    assert "train" in planned.stdout, planned.stdout
