"""Helpers for tests that start servers, clusters and tools as separate processes."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "assert_usage_errors",
    "free_port",
    "listening_addresses",
    "refused_port",
    "run_json_tool",
    "wait_for",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def refused_port(port: int = 0) -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections for as long as the block runs: ``port`` (one a
    killed server listened on) or a new one. A socket bound there that never listens holds it, so
    no other process is given it meanwhile (``bind`` to port 0, or a ``connect``'s own port, skips
    a port that is bound). A port that is only free, by contrast, can be another test's server a
    second later: a client retrying its connection for seconds then reaches that server (CI saw a
    killed scheduler's port answer again)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the dead server's TIME_WAITs
        s.bind(("127.0.0.1", port))
        yield s.getsockname()[1]


def listening_addresses(port: int, pid: int | None = None) -> set[str]:
    """The addresses the TCP sockets of process ``pid`` (default: this one) listen on at ``port``
    (``"127.0.0.1"``, ``"0.0.0.0"``, ``"::1"``, ``"::"``), read from the kernel's tables
    (``/proc/net/tcp``, ``tcp6``). Another process's socket is left out: IPv4 and IPv6 number
    their ports apart, so a test's ``::1`` port can be another test's ``127.0.0.1`` port (CI
    once saw both)."""
    owned = set()
    for fd in Path(f"/proc/{pid or os.getpid()}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed since it was listed
            continue
        if link.startswith("socket:["):
            owned.add(link[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            host, _, hexport = local.partition(":")
            if state != "0A" or int(hexport, 16) != port or inode not in owned:  # 0A: LISTEN
                continue
            raw = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def wait_for(check: Callable[[], Any], what: str, timeout: float, logs: Sequence[Path] = ()) -> Any:
    """Call ``check`` until it returns something truthy (and return that), or raise
    ``TimeoutError`` after ``timeout`` seconds with the tails of ``logs``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise TimeoutError(f"{what} not ready after {timeout} s\n{tails}")


#: Ray run by a test beside the rest of the suite (the peer benchmarks' tests check what each tool
#: delivers, not its speed). Ray starts its workers at nice 15: on a machine busy with other tests
#: each gets a sliver of a core. And ``read_parquet`` starts 32 footer-reading actors, each a
#: process, for every pass (docs/performance.md, the peers' Ray Data row). Here its workers run at
#: the suite's priority and its footer pool has 2 actors.
RAY_BESIDE_THE_SUITE = {"RAY_worker_niceness": "0", "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "2"}


def run_json_tool(
    command: Sequence[str], out: Path, *, cwd: Path, timeout: float = 600, extra_env: Mapping[str, str] = {}
) -> tuple[str, Any]:
    """Run a benchmark tool that writes JSON to ``out`` (``--out`` in ``command``), in this
    environment with ``extra_env`` over it; its stdout and that JSON. A failure fails the test with
    the end of both streams."""
    env = {**os.environ, **extra_env}
    proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def assert_usage_errors(tool: Path, work: Path, cases: Sequence[tuple[list[str], str]], *, cwd: Path) -> None:
    """``tool`` (a benchmark taking ``--work``) answers each ``(arguments, message)`` of ``cases``
    with a usage error holding ``message``, before it makes its work folder ``work``."""
    for args, message in cases:
        proc = subprocess.run(
            [sys.executable, str(tool), "--work", str(work), *args], capture_output=True, text=True, cwd=cwd
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not work.exists()
