"""One writer per local dataset: the jobs hold ``<dataset>/_lock`` while they write it.

A job that writes a local dataset (the manifest job, the shard job) holds an exclusive lock on
the dataset's ``_lock`` file from its input check to its commit; a job that only reads it to
plan (``jobs.shard --plan-only``) holds a shared one. A second job is refused at once, before
any engine starts, with one line naming the job that holds the dataset and since when
(:class:`DatasetBusyError`); it never waits, so two scheduled runs never queue up silently.

The lock is the operating system's (``flock``): the kernel releases it when its process exits,
however it exits, so a killed job leaves no stale lock and its rerun goes ahead. While an
exclusive holder runs, the file holds its description (job, process, host, start, command
line); the holder empties it before it lets go, so the file is empty when nobody writes. It stays
in the dataset (an empty ``_lock`` file is not part of the dataset, readers ignore it).

S3 has no such lock: there a shard build writes its own version folder and the last
``dataset.json`` wins whole (``docs/design/0012-versioned-shards.md``). A local filesystem that
does not support ``flock`` (some FUSE mounts) gets one WARNING and no lock.

A process may take the lock it holds again (the command shell takes it before the input
check, the job's ``run`` again): the inner hold is counted, not a second ``flock``.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lakeshard import storage
from lakeshard.errors import PlatformError

__all__ = ["LOCK_NAME", "DatasetBusyError", "dataset_lock"]

log = logging.getLogger(__name__)

#: The lock file, in the dataset root.
LOCK_NAME = "_lock"


class DatasetBusyError(PlatformError, RuntimeError):
    """Another job holds the dataset (names it, its process and since when)."""


@dataclass(slots=True)
class _Held:
    fd: int
    exclusive: bool
    count: int


# NOTE [ Lock re-entry ]
# flock locks belong to an open file description: a second open() of the same file in the same
# process would be refused by its own lock. _HELD maps a lock file's path to the one descriptor
# this process holds; a nested dataset_lock() for the same path counts up and down, and only the
# outermost release empties the file and closes the descriptor (which releases the flock).
_HELD: dict[str, _Held] = {}
_HELD_LOCK = threading.Lock()


def _describe(job: str) -> dict[str, object]:
    return {
        "job": job,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:300],
    }


def _holder(fd: int) -> str:
    """Who holds the lock, from the file's content (empty: a job that only reads the dataset)."""
    try:
        raw = os.pread(fd, 4096, 0)
        held = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        held = None
    if not isinstance(held, dict):
        return "another job is reading it (e.g. jobs/shard.py --plan-only)"
    return (
        f"{held.get('job', 'a')} job is writing it since {held.get('since', '?')} "
        f"(pid {held.get('pid', '?')} on {held.get('host', '?')}: {held.get('command', '')})"
    )


@contextmanager
def dataset_lock(root: str, *, job: str, exclusive: bool = True) -> Iterator[None]:
    """Hold the local dataset at ``root``'s lock while the block runs (nothing on S3).

    Args:
        root: the dataset root URI (its folder is created if missing).
        job: what holds it, for the refusal another job gets (``"shard"``, ``"manifest"``).
        exclusive: a job that writes the dataset; False for one that only reads it.

    Raises:
        DatasetBusyError: another process holds the lock (exclusively, or shared when
            ``exclusive``): one line naming the job that holds it.
    """
    root = storage.normalize(root)
    if not root.startswith("file://"):
        yield
        return
    folder = storage.filesystem(root)[1]
    path = os.path.join(folder, LOCK_NAME)
    with _HELD_LOCK:
        held = _HELD.get(path)
        if held is not None:
            if exclusive and not held.exclusive:
                raise DatasetBusyError(
                    f"{root}: this process holds the dataset's lock shared and asks for it exclusive"
                )
            held.count += 1
    if held is not None:
        try:
            yield
        finally:
            with _HELD_LOCK:
                held.count -= 1
        return
    fd = _acquire(root, folder, path, job=job, exclusive=exclusive)
    if fd is None:
        yield
        return
    with _HELD_LOCK:
        _HELD[path] = held = _Held(fd=fd, exclusive=exclusive, count=1)
    try:
        yield
    finally:
        with _HELD_LOCK:
            held.count -= 1
            last = held.count == 0
            if last:
                del _HELD[path]
        if last:
            try:
                if exclusive:
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # releases the flock


def _acquire(root: str, folder: str, path: str, *, job: str, exclusive: bool) -> int | None:
    """The descriptor of the locked file, or None where the filesystem cannot lock."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise DatasetBusyError(
            f"{root} is busy: {holder}; wait for it to finish (a killed job releases the lock at once), "
            "or write to another dataset"
        ) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            log.warning(
                "%s: this filesystem cannot lock %s (%s): two jobs writing this dataset at once "
                "would not be refused",
                root,
                path,
                exc.strerror,
            )
            return None
        raise
    if exclusive:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_describe(job)).encode(), 0)
    return fd
