"""The loader under faults: a corrupt row, a shard deleted mid-epoch, a rank that dies in a
2-rank torchrun. Each fails with an error naming the cause, where it happens (not at the
epoch's end), never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lakeshard import format as contract
from lakeshard.errors import LoaderError
from loaders import ShardLoader
from tests.hardening.helpers import REPO
from tests.loaders.loader_builders import write_dataset


def test_corrupt_row_error_names_shard_and_row_at_its_batch(tmp_path: Path):
    root = tmp_path / "ds"
    write_dataset(root, rows={"train": 40, "validation": 6, "test": 6}, corrupt=[("train", 1, 13)])
    uri = contract.shard_uri(str(root), "train", 1, 2)
    loader = ShardLoader(str(root), channel="train", batch_size=4, num_threads=2, prefetch=2)
    got = 0
    with pytest.raises(LoaderError) as err:
        for _ in loader:
            got += 1
    assert uri in str(err.value) and "row 13" in str(err.value), str(err.value)
    # It came at the corrupt row's batch (20 + 13) // 4 = 8 at the latest (it may overtake batches
    # still queued before it), not at the epoch's end (10 batches).
    assert got <= 8
    loader.close()


def test_shard_deleted_mid_epoch_names_the_file(tmp_path: Path):
    root = tmp_path / "ds"
    write_dataset(root, rows={"train": 60, "validation": 6, "test": 6}, row_group_rows=5)
    victim = contract.shard_uri(str(root), "train", 1, 2)
    loader = ShardLoader(
        str(root), channel="train", batch_size=5, shuffle_window=5, num_threads=1, prefetch=1
    )
    it = iter(loader)
    next(it)  # the reader is in shard 0 (30 rows, 6 batches; it runs at most prefetch + 2 ahead)
    os.remove(victim[len("file://") :])
    got = 1
    with pytest.raises(LoaderError) as err:
        for _ in it:
            got += 1
    assert got <= 6  # no batch of shard 1 (batches 6 to 11) came out: the error is where the file is
    assert victim in str(err.value) and "No such file" in str(err.value), str(err.value)
    loader.close()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_dying_rank_fails_the_run_with_the_cause_instead_of_hanging(tmp_path: Path):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 80, "validation": 10, "test": 10}, num_shards=2, size=16)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "tests.hardening.dying_train",
        "--dataset",
        str(data),
        "--batch-size",
        "8",
        "--epochs",
        "3",
        "--no-progress",
        "--width",
        "4",
        "--output",
        str(tmp_path / "run"),
        "--dist-timeout",
        "20",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "LAKESHARD_DIE_RANK": "1",
        "LAKESHARD_DIE_AFTER": "2",
    }
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank0 INFO loaders.train.loop: rank 0/2 joined the gloo process group" in out, out[-3000:]
    assert "dying_train: rank 1 dies now" in out
    # The cause is named: the failed rank and its exit code (torchrun's report), not a timeout
    # after minutes of waiting.
    assert "exitcode  : 9" in out or "exitcode: 9" in out or "exit code 9" in out, out[-3000:]
    assert "rank      : 1" in out or "local_rank: 1" in out, out[-3000:]
    assert elapsed < 180, f"the run took {elapsed:.0f} s to fail"
