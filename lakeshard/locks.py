"""One writer per dataset: the jobs hold ``<dataset>/_lock`` while they write it.

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

On S3 the lock is the object ``<dataset>/_lock``, created with a conditional PUT
(``If-None-Match: *``, :func:`lakeshard.storage.create_if_absent`): of two jobs, exactly one
creates it, and the other is refused with the same line. No process dies with it, so it expires:
its holder rewrites it every quarter of :data:`S3_LOCK_EXPIRY` (``If-Match`` its own last write)
and deletes it at the end; a lock left unrefreshed longer than that (by the store's clock: the
object's ``Last-Modified`` against the answer's ``Date``) is a killed job's, and the next job
takes it over, as it does at once a lock whose holder ran on this host and is gone. A holder
that finds its lock taken over (it was stalled past the expiry) stops before its commit
(:func:`confirm`). ``--plan-only`` takes no lock on S3 (it writes nothing a build reads or
removes). A store without conditional writes (it answers 501 or 400) gets one WARNING and no
lock. A local filesystem that does not support ``flock`` (some FUSE mounts) gets one WARNING
and no lock; one that cannot be written (read-only) refuses a job that writes with one line,
and lets one that only reads go on (shared, if the lock file is there; else with a WARNING and
no lock).

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from lakeshard import storage
from lakeshard.errors import NoConditionalWrites, PlatformError, StorageError

__all__ = ["LOCK_NAME", "S3_LOCK_EXPIRY", "DatasetBusyError", "confirm", "dataset_lock", "holds"]

log = logging.getLogger(__name__)

#: The lock file, in the dataset root.
LOCK_NAME = "_lock"

#: Seconds an S3 lock stays its holder's without a refresh (written into the lock, so a taker
#: honours the holder's figure); the holder refreshes it every quarter of that.
S3_LOCK_EXPIRY = 60.0


class DatasetBusyError(PlatformError, RuntimeError):
    """Another job holds the dataset (names it, its process and since when)."""


@dataclass(slots=True)
class _Held:
    release: Callable[[], None]
    exclusive: bool
    count: int
    #: Raises DatasetBusyError if the lock is no longer this process's (an S3 lock taken over).
    confirm: Callable[[], None] = field(default=lambda: None)


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
    except OSError:
        raw = b""
    return _holder_text(raw)


def _holder_text(raw: bytes) -> str:
    """Who holds the lock, from its content (empty: a job that only reads the dataset)."""
    try:
        held = json.loads(raw) if raw.strip() else None
    except ValueError:
        held = None
    if not isinstance(held, dict):
        return "another job is reading it (e.g. jobs/shard.py --plan-only)"
    return (
        f"{held.get('job', 'a')} job is writing it since {held.get('since', '?')} "
        f"(pid {held.get('pid', '?')} on {held.get('host', '?')}: {held.get('command', '')})"
    )


@contextmanager
def dataset_lock(root: str, *, job: str, exclusive: bool = True) -> Iterator[None]:
    """Hold the dataset at ``root``'s lock while the block runs (local: ``flock``; S3: a
    conditionally created object, refreshed while held; shared on S3: nothing).

    Args:
        root: the dataset root URI (a local folder is created if missing).
        job: what holds it, for the refusal another job gets (``"shard"``, ``"manifest"``).
        exclusive: a job that writes the dataset; False for one that only reads it.

    Raises:
        DatasetBusyError: another process holds the lock (exclusively, or shared when
            ``exclusive``): one line naming the job that holds it.
        StorageError: a job that writes a local dataset that cannot be written (read-only).
    """
    root = storage.normalize(root)
    if storage.is_local(root):
        folder = storage.filesystem(root)[1]
        path = os.path.join(folder, LOCK_NAME)
    elif exclusive:
        path = storage.join(root, LOCK_NAME)
    else:
        yield
        return
    with _HELD_LOCK:
        held = _HELD.get(path)
        if held is not None:
            if exclusive and not held.exclusive:
                raise DatasetBusyError(
                    f"{root}: this process holds the dataset's lock shared and asks for it exclusive"
                )
            held.count += 1
    if held is None:
        if storage.is_local(root):
            held = _acquire(root, folder, path, job=job, exclusive=exclusive)
        else:
            held = _acquire_s3(root, path, job=job)
        if held is None:
            yield
            return
        with _HELD_LOCK:
            _HELD[path] = held
    try:
        yield
    finally:
        with _HELD_LOCK:
            held.count -= 1
            last = held.count == 0
            if last:
                del _HELD[path]
        if last:
            held.release()


def holds(root: str) -> bool:
    """Whether this process holds ``root``'s lock exclusively (False where it could not lock)."""
    held = _HELD.get(_lock_path(storage.normalize(root)))
    return held is not None and held.exclusive


def confirm(root: str) -> None:
    """Check, just before a commit, that this process still holds ``root``'s lock.

    Raises:
        DatasetBusyError: another job took the lock over (S3: this one was stalled past
            :data:`S3_LOCK_EXPIRY`); commit nothing.
    """
    held = _HELD.get(_lock_path(storage.normalize(root)))
    if held is not None:
        held.confirm()


def _lock_path(root: str) -> str:
    return (
        os.path.join(storage.local_path(root), LOCK_NAME) if storage.is_local(root) else f"{root}/{LOCK_NAME}"
    )


def _busy(root: str, holder: str, release: str) -> DatasetBusyError:
    return DatasetBusyError(
        f"{root} is busy: {holder}; wait for it to finish ({release}), or write to another dataset"
    )


def _acquire(root: str, folder: str, path: str, *, job: str, exclusive: bool) -> _Held | None:
    """The local lock, held (None where the filesystem cannot lock, or cannot be written by a
    job that only reads)."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        if exclusive:
            raise StorageError(
                f"{root} cannot be written ({exc.strerror}: {exc.filename}): a {job} job writes the dataset; "
                "write it where this user may write, or mount it read-write"
            ) from None
        read_only = _open_read_only(root, path, exc)
        if read_only is None:
            return None
        fd = read_only
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise _busy(root, holder, "a killed job releases the lock at once") from None
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

    def release() -> None:
        try:
            if exclusive:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # releases the flock

    return _Held(release=release, exclusive=exclusive, count=1)


def _open_read_only(root: str, path: str, exc: OSError) -> int | None:
    """A job that only reads a dataset it cannot write: the existing lock file opened for
    reading (a shared ``flock`` needs no write access), or None (no lock file: go on unlocked)."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        log.warning(
            "%s cannot be written (%s): reading it without the dataset's lock (a job writing it "
            "meanwhile would not be seen)",
            root,
            exc.strerror,
        )
        return None


# NOTE [ S3 lock refresh ]
# _acquire_s3 starts one daemon thread per held S3 lock. It waits on `stop` (set by release)
# for a quarter of the expiry, then rewrites the lock If-Match its last ETag, with its refresh
# time in it (another ETag each time); the new ETag replaces `etag` (only that thread writes it,
# under `guard`). A refresh the store refuses (the lock was taken over or deleted) sets `lost`
# and ends the thread; confirm() raises on `lost`, and also asks the store itself (a refresh may
# be due). release sets `stop`, joins the thread, then deletes the lock If-Match the last ETag
# (never a lock another job has taken over); a store that fails then leaves it to expire.
@dataclass(slots=True)
class _S3Lock:
    uri: str
    root: str
    held: dict[str, object]  #: what the lock says (its description and expiry)
    etag: str
    expiry: float
    stop: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    guard: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread = field(init=False)

    def refresh_until_stopped(self) -> None:
        while not self.stop.wait(self.expiry / 4):
            with self.guard:
                try:
                    # each write another body, so another ETag: a taker's If-Match delete of
                    # what it read as stale fails once this refresh is in
                    self.held["refreshed"] = dt.datetime.now(dt.timezone.utc).isoformat(
                        timespec="milliseconds"
                    )
                    body = json.dumps(self.held).encode()
                    etag = storage.replace_if_unchanged(self.uri, body, self.etag)
                except Exception as exc:  # the store is down: the next refresh tries again
                    log.warning("cannot refresh the lock %s: %s", self.uri, exc)
                    continue
                if etag is None:
                    log.error(
                        "%s: another job took this job's lock over; this job will not commit", self.root
                    )
                    self.lost.set()
                    return
                self.etag = etag

    def confirm(self) -> None:
        if not self.lost.is_set():
            with self.guard:
                try:
                    etag = storage.store_for(self.uri).get(self.uri).etag
                except FileNotFoundError:
                    etag = None
                if etag == self.etag:
                    return
        raise DatasetBusyError(
            f"{self.root}: another job took this job's lock over (this job was stalled for more than "
            f"{self.expiry:g} s); nothing was committed: run it again when the other job is done"
        )

    def release(self) -> None:
        self.stop.set()
        thread = self.thread
        thread.join()
        if self.lost.is_set():
            return
        try:
            storage.remove_if_unchanged(self.uri, self.etag)
        except PlatformError as exc:  # the job's own outcome matters more: the lock expires
            log.warning("cannot delete the lock %s (it expires in %g s): %s", self.uri, self.expiry, exc)


def _acquire_s3(root: str, uri: str, *, job: str) -> _Held | None:
    """The S3 lock, created (or taken over from a killed job), refreshed while held; None where
    the store has no conditional writes."""
    held: dict[str, object] = {**_describe(job), "expires_after_s": S3_LOCK_EXPIRY}
    body = json.dumps(held).encode()
    try:
        etag = storage.create_if_absent(uri, body)
        if etag is None:
            etag = _take_over(root, uri, body)
    except NoConditionalWrites as exc:
        log.warning("%s: %s; two jobs writing this dataset at once would not be refused", root, exc)
        return None
    lock = _S3Lock(uri=uri, root=root, held=held, etag=etag, expiry=S3_LOCK_EXPIRY)
    lock.thread = threading.Thread(target=lock.refresh_until_stopped, name=f"lock {uri}", daemon=True)
    lock.thread.start()
    return _Held(release=lock.release, exclusive=True, count=1, confirm=lock.confirm)


def _take_over(root: str, uri: str, body: bytes) -> str:
    """The lock's ETag after taking it over from a holder that stopped refreshing it (or that
    released it since): raises DatasetBusyError while its holder keeps it."""
    try:
        found = storage.store_for(uri).get(uri)
    except FileNotFoundError:
        etag = storage.create_if_absent(uri, body)  # released between our PUT and GET
    else:
        etag = None
        held, age = found.data, found.age_s  # age: by the store's clock, so the hosts' do not matter
        expiry = _expiry(held)
        dead = _died_here(held)
        if (dead or age > expiry) and storage.remove_if_unchanged(uri, found.etag or ""):
            log.warning(
                "%s: taking over the lock of a job that %s: %s",
                root,
                "died on this host"
                if dead
                else f"stopped refreshing it {age:.0f} s ago (expiry {expiry:g} s)",
                held.decode(errors="replace")[:300],
            )
            etag = storage.create_if_absent(uri, body)
        if etag is None:
            raise _busy(
                root,
                _holder_text(held),
                f"a killed job's lock expires {expiry:g} s after its last refresh, {max(0.0, expiry - age):.0f} s from now",
            )
    if etag is None:
        raise _busy(root, "another job took the lock just now", "a killed job's lock expires")
    return etag


def _died_here(held: bytes) -> bool:
    """Whether the lock's holder ran on this host and its process is gone (a job killed here,
    run again here: no need to wait for the expiry). A reused pid only makes this wait."""
    try:
        owner = json.loads(held)
        pid, host = int(owner["pid"]), owner["host"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _expiry(held: bytes) -> float:
    try:
        value = float(json.loads(held).get("expires_after_s", S3_LOCK_EXPIRY))
    except (ValueError, AttributeError, TypeError):
        return S3_LOCK_EXPIRY
    return value if value > 0 else S3_LOCK_EXPIRY
