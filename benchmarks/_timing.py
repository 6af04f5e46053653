"""What the benchmark tools share: the order of repeats, paired ratios, the CPU other processes
took meanwhile, the CPU seconds of a process and of this process's tree, ``option=value``
variants, the checkout of a git ref that A/B tools run, and the JSON they write. Not a tool: imported by the tools beside it (standard library
only at import, so a peer's environment can import it too)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "alternate",
    "cpu_seconds",
    "other_load",
    "paired",
    "parse_variant",
    "ref_checkout",
    "tree_cpu_s",
    "write_json",
    "write_runs",
]

_T = TypeVar("_T")
_TICKS = os.sysconf("SC_CLK_TCK")


def alternate(items: Sequence[_T], repeat: int) -> list[_T]:
    """``items`` in order on even repeats, reversed on odd ones: a slow spell of the machine
    hits each side of a comparison alike."""
    return list(items) if repeat % 2 == 0 else list(items)[::-1]


def paired(tops: Iterable[float], bottoms: Iterable[float]) -> float:
    """The median of each repeat's own ratio ``top / bottom`` (both measured moments apart): a
    slow spell lowers both sides of one repeat instead of one side's median."""
    return float(statistics.median(a / b for a, b in zip(tops, bottoms, strict=True)))


@contextlib.contextmanager
def other_load() -> Iterator[Callable[[], float]]:
    """Share of the machine's CPU time that others took meanwhile: other processes, and the
    hypervisor (steal time) (Linux; NaN elsewhere). A run taken while the machine was busy
    shows it here instead of hiding."""

    def busy_jiffies() -> int:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(v) - v[3] - v[4]  # all but idle and iowait

    if not os.path.exists("/proc/stat"):
        yield lambda: float("nan")
        return
    cores = os.cpu_count() or 1
    b0, t0, w0 = busy_jiffies(), os.times(), time.perf_counter()
    result: list[float] = []
    yield lambda: result[0]
    b1, t1, w1 = busy_jiffies(), os.times(), time.perf_counter()
    own = (t1.user + t1.system) - (t0.user + t0.system)
    result.append(max(0.0, ((b1 - b0) / _TICKS - own) / ((w1 - w0) * cores)))


def cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(start time, user + system CPU seconds) of process ``pid`` from ``/proc/<pid>/stat``, in
    clock ticks' resolution (``None`` once it is gone). The start time tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime, start = int(fields[11]), int(fields[12]), int(fields[19])
    return start / _TICKS, (utime + stime) / _TICKS


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process, its live descendants, and every descendant
    already reaped (counted in its parent's ``children_*`` times)."""
    return _tree_cpu_s(os.getpid(), reaped=True)


def procs_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` and their live descendants (nginx's
    workers) have used so far; a process gone counts nothing."""
    return sum(_tree_cpu_s(pid, reaped=False) for pid in pids)


def _tree_cpu_s(pid: int, *, reaped: bool) -> float:
    import psutil  # not at the top: the tools that never call this need not have it

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue  # exited meanwhile: its parent's children_* times hold it once reaped
        total += t.user + t.system + ((t.children_user + t.children_system) if reaped else 0.0)
    return total


def parse_variant(text: str, options: Iterable[str], owner: str) -> dict[str, object]:
    """``"partitions=4,threads=1"`` as keyword arguments: integers as ``int``, ``none`` as
    ``None``, anything else as text. A key that is not one of ``options`` is an
    ``ArgumentTypeError`` naming it (``owner``: whose options they are)."""
    known = set(options)
    out: dict[str, object] = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        if key not in known:
            raise argparse.ArgumentTypeError(f"{key!r} in variant {text!r} is not a {owner} option")
        out[key] = None if value == "none" else int(value) if value.lstrip("-").isdigit() else value
    return out


@contextlib.contextmanager
def ref_checkout(root: Path, ref: str, at: Path, *, extensions: bool = True) -> Iterator[Path]:
    """The code at git ``ref`` of the repository ``root``, checked out at ``at`` with ``git
    worktree`` and removed when the block ends. ``extensions``: ``root``'s built C extensions of
    the loader are copied in (the C sources must be the same)."""
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(at), ref], cwd=root, check=True)
    try:
        if extensions:
            for built in (root / "loaders").glob("_*.so"):
                shutil.copy2(built, at / "loaders" / built.name)
        yield at
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(at)], cwd=root, check=False)
        shutil.rmtree(at, ignore_errors=True)


def write_json(out: Path | str | None, doc: Any, *, indent: int = 2) -> None:
    """``doc`` as JSON in ``out`` (its folder made; nothing if ``out`` is ``None``)."""
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=indent) + "\n")


def write_runs(out: Path | None, args: argparse.Namespace, runs: dict[str, Any]) -> None:
    """Write the command line's arguments and every run to ``out`` as JSON (nothing if ``None``)."""
    write_json(out, {"args": {k: str(x) for k, x in vars(args).items()}, "runs": runs})
