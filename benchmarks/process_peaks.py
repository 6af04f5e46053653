"""Peak memory of a job's driver, sampled from outside while the job runs.

:class:`PeakWatch` runs a command (a ``spark-submit`` or ``python -m jobs.<job>`` line) and, every
``interval`` seconds until it exits, samples:

- the **driver Python process's peak RSS**: ``VmHWM`` in ``/proc/<pid>/status``, the kernel's
  own high-water mark of the process's resident set (so sampling only misses growth in the last
  interval before the process exits). Under ``spark-submit`` the driver Python is the child of
  the ``SparkSubmit`` JVM whose command line holds the job's script; with ``python -m`` it is the
  command itself (a Dask LocalCluster's workers are other processes and are not counted; its
  scheduler runs in the client process and is).
- the **driver JVM's heap** (Spark only): ``jstat -gc <pid> <ms>``, the JDK's own reader of the
  JVM's performance counters (no attach, no agent, nothing changed in the JVM's options), gives
  the used bytes of the survivor, eden and old spaces at every tick. ``heap_used_peak`` is the
  highest sum of those (garbage not yet collected included); ``old_used_peak`` is the highest old
  space, which holds what survives collections. The JVM's own peak RSS is reported too. In
  ``local[N]`` mode the driver's JVM also runs the executor's tasks.
- the **CPU seconds (user + system) of the whole process tree**: at every sample, ``utime`` and
  ``stime`` of ``/proc/<pid>/stat`` of the command and every descendant (``spark-submit``'s JVM
  and its Python workers; the Dask job's client, scheduler, nannies and workers), each process's
  last value kept, keyed by (pid, start time) so a reused pid is a new process. ``tree_cpu_s`` is
  their sum. It misses the CPU of a process that lives less than one sample interval (never
  seen), and the last interval of each process before it exits. As a cross-check
  ``reaped_cpu_s`` is the kernel's own account from ``wait4``: the command plus every descendant
  that was waited for (by its parent, recursively), exact for those, blind to descendants not
  waited for (orphans, processes killed and left to ``init``). CPU time does not grow with other
  load on the machine the way wall time does, so it compares runs made at different loads.
- the **driver's own CPU seconds** (``driver_python_cpu_s``, and ``jvm_cpu_s`` for Spark): the
  driver Python's is the job's serial share; in ``local[N]`` mode the JVM's holds the executor's
  tasks too.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil
from _timing import cpu_seconds

__all__ = ["PeakWatch", "Peaks", "jstat_heap", "vm_hwm", "vm_rss"]

_MIB = 1024 * 1024


def vm_hwm(pid: int) -> int | None:
    """The peak resident set of process ``pid`` so far, in bytes (``None`` once it is gone)."""
    return _status_bytes(pid, "VmHWM:")


def vm_rss(pid: int) -> int | None:
    """The resident set of process ``pid`` now, in bytes (``None`` once it is gone)."""
    return _status_bytes(pid, "VmRSS:")


def _status_bytes(pid: int, name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def jstat_heap(header: str, line: str) -> tuple[int, int] | None:
    """(heap used, old space used) in bytes from one ``jstat -gc`` line under ``header``;
    ``None`` for a line that is not a sample (a repeated header, an error)."""
    names = header.split()
    values = line.split()
    if len(values) != len(names):
        return None
    try:
        kib = {n: float(v) for n, v in zip(names, values, strict=True) if n in ("S0U", "S1U", "EU", "OU")}
    except ValueError:
        return None
    if len(kib) != 4:
        return None
    return int(sum(kib.values()) * 1024), int(kib["OU"] * 1024)


@dataclass
class Peaks:
    """What a run's driver used at most (bytes), with how many samples saw it."""

    wall_s: float = 0.0
    returncode: int | None = None
    driver_python_pid: int | None = None
    driver_python_rss_peak: int | None = None
    jvm_pid: int | None = None
    jvm_rss_peak: int | None = None
    jvm_heap_used_peak: int | None = None
    jvm_old_used_peak: int | None = None
    jvm_heap_samples: int = 0
    samples: int = 0
    tree_cpu_s: float = 0.0
    tree_processes: int = 0
    reaped_cpu_s: float | None = None
    driver_python_cpu_s: float | None = None
    jvm_cpu_s: float | None = None
    notes: list[str] = field(default_factory=list)
    _cpu: dict[tuple[int, float], float] = field(default_factory=dict, repr=False)

    def see_cpu(self, pid: int) -> float | None:
        """Record process ``pid``'s CPU seconds so far (its last value is kept); returns them."""
        sample = cpu_seconds(pid)
        if sample is None:
            return None
        self._cpu[(pid, sample[0])] = sample[1]
        self.tree_cpu_s = sum(self._cpu.values())
        self.tree_processes = len(self._cpu)
        return sample[1]

    def mib(self, name: str) -> float | None:
        value = getattr(self, name)
        return None if value is None else round(value / _MIB, 1)


class PeakWatch:
    """Run ``cmd`` (with ``env``, in ``cwd``, its output to ``log``) and sample its driver's
    memory every ``interval`` seconds; ``script`` names the driver Python under ``spark-submit``
    (a path its command line holds), ``None`` when the command itself is the driver Python.
    ``progress`` is called every ``progress_every`` seconds with the peaks so far."""

    def __init__(
        self,
        cmd: list[str],
        *,
        env: dict[str, str],
        cwd: Path,
        log: IO[str],
        script: str | None,
        interval: float = 0.1,
        progress=None,
        progress_every: float = 30.0,
    ) -> None:
        self.cmd, self.env, self.cwd, self.log, self.script = cmd, env, cwd, log, script
        self.interval, self.progress, self.progress_every = interval, progress, progress_every
        self.peaks = Peaks()
        self._jstat: subprocess.Popen[str] | None = None
        self._jstat_thread: threading.Thread | None = None

    def run(self) -> Peaks:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=self.cwd, stdout=self.log, stderr=subprocess.STDOUT
        )
        next_report = t0 + self.progress_every
        try:
            while not self._reaped(proc):
                self._sample(proc.pid)
                now = time.perf_counter()
                if self.progress and now >= next_report:
                    self.progress(now - t0, self.peaks)
                    next_report = now + self.progress_every
                time.sleep(self.interval)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self.peaks.wall_s = time.perf_counter() - t0
            self.peaks.returncode = proc.returncode
            self._stop_jstat()
        return self.peaks

    def _reaped(self, proc: subprocess.Popen[bytes]) -> bool:
        """Whether ``proc`` has exited; reaps it with ``wait4`` to read the kernel's CPU account of
        it and its waited-for descendants (``Popen.poll`` would reap it without)."""
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == 0:
            return False
        proc.returncode = os.waitstatus_to_exitcode(status)
        self.peaks.reaped_cpu_s = round(usage.ru_utime + usage.ru_stime, 3)
        return True

    def _sample(self, pid: int) -> None:
        p = self.peaks
        p.samples += 1
        if self.script is None:
            p.driver_python_pid = pid
        else:
            self._find_spark_driver(pid)
        if p.driver_python_pid is not None:
            p.driver_python_rss_peak = _max(p.driver_python_rss_peak, vm_hwm(p.driver_python_pid))
        if p.jvm_pid is not None:
            p.jvm_rss_peak = _max(p.jvm_rss_peak, vm_hwm(p.jvm_pid))
        self._sample_cpu(pid)

    def _sample_cpu(self, pid: int) -> None:
        """Every process of the tree under ``pid`` (``pid`` included): its CPU seconds so far."""
        p = self.peaks
        try:
            tree = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return
        for member in tree:
            seconds = p.see_cpu(member)
            if seconds is not None and member == p.driver_python_pid:
                p.driver_python_cpu_s = seconds
            if seconds is not None and member == p.jvm_pid:
                p.jvm_cpu_s = seconds

    def _find_spark_driver(self, pid: int) -> None:
        """``spark-submit`` execs its way to the ``SparkSubmit`` JVM (same pid), which starts
        the driver Python as its child."""
        p = self.peaks
        try:
            proc = psutil.Process(pid)
            if (
                p.jvm_pid is None
                and proc.name() == "java"
                and any("SparkSubmit" in a for a in proc.cmdline())
            ):
                p.jvm_pid = pid
                self._start_jstat(pid)
            children = proc.children() if p.jvm_pid is not None and p.driver_python_pid is None else []
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return
        for child in children:  # the JVM's Python workers too, some of them zombies for a moment
            try:
                if any(a.endswith(self.script) for a in child.cmdline()):
                    p.driver_python_pid = child.pid
                    return
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue

    def _start_jstat(self, pid: int) -> None:
        ms = max(50, int(self.interval * 1000) * 2)
        self._jstat = subprocess.Popen(
            ["jstat", "-gc", str(pid), f"{ms}ms"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._jstat_thread = threading.Thread(target=self._read_jstat, args=(self._jstat,), daemon=True)
        self._jstat_thread.start()

    def _read_jstat(self, jstat: subprocess.Popen[str]) -> None:
        p = self.peaks
        header = ""
        for line in jstat.stdout or ():
            if "EU" in line.split():
                header = line
                continue
            heap = jstat_heap(header, line) if header else None
            if heap is None:
                if line.strip() and not header:
                    p.notes.append(f"jstat: {line.strip()}")
                continue
            p.jvm_heap_samples += 1
            p.jvm_heap_used_peak = _max(p.jvm_heap_used_peak, heap[0])
            p.jvm_old_used_peak = _max(p.jvm_old_used_peak, heap[1])

    def _stop_jstat(self) -> None:
        if self._jstat is not None:
            # jstat ends by itself when the JVM does; give it a moment to print its last line.
            try:
                self._jstat.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._jstat.kill()
                self._jstat.wait()
        if self._jstat_thread is not None:
            self._jstat_thread.join(timeout=5)


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
