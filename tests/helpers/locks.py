"""A dataset lock held by another process (:mod:`lakeshard.locks`), for the tests of the lock
and of the jobs that meet it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.hardening.helpers import job_env

_HOLD = """
import sys
from lakeshard import locks
from lakeshard.locks import dataset_lock
if len(sys.argv) > 3:  # the expiry this holder writes into its S3 lock
    locks.S3_LOCK_EXPIRY = float(sys.argv[3])
with dataset_lock(sys.argv[1], job="test", exclusive=sys.argv[2] == "x"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def held_elsewhere(root: Path | str, *, exclusive: bool, expiry: float = 0) -> Iterator[subprocess.Popen]:
    """A process holding ``root``'s lock until the block ends (its stdin closed); ``expiry``: the
    expiry it writes into an S3 lock (0: the default)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _HOLD,
            str(root),
            "x" if exclusive else "s",
            *([str(expiry)] if expiry else []),
        ],
        env=job_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
