"""The benchmarks' remote-like store (``benchmarks/remote_store.py``: nginx behind a latency
shim) for tests that need a store with its own request log or a slow link."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from remote_store import NginxMissingError, RemoteStore, find_nginx

__all__ = ["RemoteStore", "require_nginx"]


def require_nginx() -> str:
    """nginx's path: a missing nginx fails the test (with how to install it), never skips it."""
    try:
        return find_nginx()
    except NginxMissingError as exc:
        pytest.fail(str(exc))
