"""Helpers for tests that start servers, clusters and tools as separate processes."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["free_port", "run_json_tool", "wait_for"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def run_json_tool(command: Sequence[str], out: Path, *, cwd: Path, timeout: float = 600) -> tuple[str, Any]:
    """Run a benchmark tool that writes JSON to ``out`` (``--out`` in ``command``); its stdout and
    that JSON. A failure fails the test with the end of both streams."""
    proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())
