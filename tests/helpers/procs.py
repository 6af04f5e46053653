"""Helpers for tests that start servers and clusters as separate processes."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["free_port", "wait_for"]


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
