"""The dataset lock (:mod:`lakeshard.locks`): held by another process, it refuses with the
holder named; shared holders coexist; a process may take its own lock again; S3 takes none."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lakeshard.locks import LOCK_NAME, DatasetBusyError, dataset_lock
from tests.hardening.helpers import job_env

_HOLD = """
import sys
from lakeshard.locks import dataset_lock
with dataset_lock(sys.argv[1], job="test", exclusive=sys.argv[2] == "x"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def _held_elsewhere(root: Path, *, exclusive: bool) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root), "x" if exclusive else "s"],
        env=job_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_an_exclusive_holder_is_named_and_released_with_its_process(tmp_path: Path):
    with _held_elsewhere(tmp_path, exclusive=True) as holder:
        for exclusive in (True, False):
            with pytest.raises(DatasetBusyError) as err:
                with dataset_lock(str(tmp_path), job="mine", exclusive=exclusive):
                    pass
            assert f"file://{tmp_path} is busy: test job is writing it since " in str(err.value)
            assert f"pid {holder.pid} on " in str(err.value)
    assert (tmp_path / LOCK_NAME).read_text() == ""  # emptied by its holder
    with dataset_lock(str(tmp_path), job="mine"):
        assert '"job": "mine"' in (tmp_path / LOCK_NAME).read_text()


def test_shared_holders_coexist_and_keep_a_writer_out(tmp_path: Path):
    with _held_elsewhere(tmp_path, exclusive=False):
        with dataset_lock(str(tmp_path), job="plan", exclusive=False):
            pass
        with pytest.raises(DatasetBusyError, match="another job is reading it"):
            with dataset_lock(str(tmp_path), job="shard"):
                pass


def test_a_process_takes_its_own_lock_again(tmp_path: Path):
    with dataset_lock(str(tmp_path), job="shard"):
        with dataset_lock(str(tmp_path), job="shard"):
            pass
        assert '"job": "shard"' in (tmp_path / LOCK_NAME).read_text()  # still held after the inner release
    assert (tmp_path / LOCK_NAME).read_text() == ""


def test_s3_takes_no_lock(tmp_path: Path):
    with dataset_lock("s3://bucket/ds", job="shard"), dataset_lock("s3://bucket/ds", job="shard"):
        pass
