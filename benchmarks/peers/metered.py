"""A command run in a cgroup of its own, for the jobs benchmark (``jobs_run.py``): its wall time,
the CPU time of its whole process tree and the tree's peak PSS.

The CPU is the cgroup's ``cpuacct.usage`` (cgroup v1, ``/sys/fs/cgroup/cpuacct``): every process
the command starts joins the cgroup, so a JVM, its Python workers, Ray's raylet and workers and a
Dask cluster's processes count, reaped or not, daemonized or not (the usual resource counters,
``wait4``'s and a walk of ``/proc``'s children, miss the processes that leave the tree). Where no
cgroup can be made (not root, no cgroup v1), the CPU is sampled from ``/proc`` for the command's
tree instead (``process_peaks.Peaks``: it misses what leaves the tree, and the last interval of
each process) and the result says so. Peak PSS (a page shared by N processes counts 1/N in
each) is sampled every ``interval`` over the cgroup's processes (or the tree's). Processes of the
cgroup that outlive the command are killed, by pid, and counted; the cgroup is removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import IO

import psutil
from process_peaks import Peaks

__all__ = ["CGROUP_ROOT", "Metered", "cgroup_available", "run_metered"]

#: Where cgroup v1's CPU accounting controller is mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup/cpuacct")


@dataclass(frozen=True)
class Metered:
    """What one command did: its exit status and standard output, and what it cost."""

    returncode: int | None  #: None: it ran past its timeout and was killed
    stdout: str
    wall_s: float
    cpu_s: float  #: user + system CPU seconds of every process it started
    cpu_from: str  #: ``cgroup`` (``cpuacct.usage``) or ``proc samples`` (no cgroup could be made)
    peak_pss: int  #: bytes, the highest sum over its processes
    leftover: int  #: processes still in its cgroup when it ended (killed)
    #: ``(time.time(), CPU seconds so far)`` every sampling interval (cgroup only; else empty)
    cpu_samples: tuple[tuple[float, float], ...] = ()

    def cpu_s_between(self, start: float, end: float) -> float | None:
        """CPU seconds spent between two ``time.time()`` moments, interpolated between samples;
        None without samples around both."""
        at = [_interpolated(self.cpu_samples, t) for t in (start, end)]
        return None if None in at else at[1] - at[0]  # type: ignore[operator]


def _interpolated(samples: tuple[tuple[float, float], ...], t: float) -> float | None:
    for (t0, c0), (t1, c1) in pairwise(samples):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c0
    return None


class _Cgroup:
    """A fresh cpuacct cgroup; ``join`` runs in the child before it executes the command."""

    def __init__(self) -> None:
        self.path = CGROUP_ROOT / f"lakeshard-bench-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def cpu_s(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def empty(self, *, wait_s: float) -> int:
        """Kill what is left in it (after ``wait_s`` for it to end by itself); how many were left."""
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.pids()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(left)

    def remove(self) -> None:
        self.path.rmdir()


def _cgroup() -> _Cgroup | None:
    try:
        return _Cgroup()
    except OSError:
        return None


def cgroup_available() -> bool:
    """Whether a run here gets a cgroup of its own (else its CPU is sampled from ``/proc``)."""
    group = _cgroup()
    if group is not None:
        group.remove()
    return group is not None


class _Sampler:
    """Every ``interval`` seconds on a daemon thread: the processes' summed PSS (its peak) and,
    for the ``/proc`` fallback, each one's CPU seconds."""

    def __init__(
        self, pids: Callable[[], list[int]], interval: float, cpu_s: Callable[[], float] | None = None
    ) -> None:
        self._pids = pids
        self.interval = interval
        self.peak_pss = 0
        self.cpu = Peaks()
        self._cpu_s = cpu_s
        self.cpu_samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        if self._cpu_s is not None:
            self.cpu_samples.append((time.time(), self._cpu_s()))
        pss = 0
        for pid in self._pids():
            try:
                pss += psutil.Process(pid).memory_full_info().pss
            except psutil.Error:
                continue
            self.cpu.see_cpu(pid)
        self.peak_pss = max(self.peak_pss, pss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _tree(pid: int) -> list[int]:
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return []


def run_metered(
    cmd: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    stderr: IO[str],
    timeout: float,
    interval: float = 0.1,
) -> Metered:
    """Run ``cmd`` in a cgroup of its own (its standard error to ``stderr``), at most ``timeout``
    seconds, and measure it."""
    group = _cgroup()
    # Standard output goes to a file, not a pipe: a process the command leaves behind (a daemon
    # that kept the descriptor) must not hold the end of the command up.
    with tempfile.TemporaryFile("w+") as out:
        t0, start = time.perf_counter(), time.time()
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=stderr,
            text=True,
            preexec_fn=group.join if group is not None else None,
        )
        if group is not None:
            sampler = _Sampler(group.pids, interval, group.cpu_s)
        else:
            sampler = _Sampler(lambda: _tree(proc.pid), interval)
        returncode: int | None
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
        wall = time.perf_counter() - t0
        ended = (time.time(), group.cpu_s() if group is not None else 0.0)
        out.seek(0)
        stdout = out.read()
    sampler.close()
    if group is None:
        return Metered(returncode, stdout, wall, sampler.cpu.tree_cpu_s, "proc samples", sampler.peak_pss, 0)
    try:
        leftover = group.empty(wait_s=5)
        # The command's start (a fresh cgroup has used nothing) and its end, around the samples.
        samples = ((start, 0.0), *sampler.cpu_samples, ended)
        return Metered(returncode, stdout, wall, group.cpu_s(), "cgroup", sampler.peak_pss, leftover, samples)
    finally:
        group.remove()
