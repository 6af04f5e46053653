"""Azurite's blob service (the npm package ``azurite``, installed by scripts/setup_azurite.sh) on
127.0.0.1, for the ``az://`` tests: started by the session fixture ``az_endpoint`` in
tests/conftest.py and stopped after. The account is Azurite's well-known ``devstoreaccount1``
(its key is public, in Azurite's documentation): tests only."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

__all__ = ["ACCOUNT", "ACCOUNT_KEY", "Azurite", "connection_string", "find_azurite"]

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_INSTALLED = (
    Path(__file__).resolve().parents[2] / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
)


def connection_string(endpoint: str) -> str:
    """A connection string for ``devstoreaccount1`` at ``endpoint`` (``http://host:port``)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )


def find_azurite() -> str:
    """The ``azurite-blob`` command: ``LAKESHARD_AZURITE``, scripts/setup_azurite.sh's, or on
    PATH. A missing one fails the test naming the setup script (never a skip)."""
    for candidate in (os.environ.get("LAKESHARD_AZURITE"), str(_INSTALLED), shutil.which("azurite-blob")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "Azurite is not installed: run `bash scripts/setup_azurite.sh` (npm install of azurite into "
        ".tools/azurite), or set LAKESHARD_AZURITE to an azurite-blob command"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Azurite:
    """One ``azurite-blob`` process, in memory, on a free port of 127.0.0.1; ``endpoint`` is
    ``http://127.0.0.1:<port>``. ``log`` is its debug log: every request it served."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="azurite-")
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = Path(self._dir, "debug.log")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> Azurite:
        command = [
            find_azurite(),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(self.port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--debug",
            str(self.log),
        ]
        with open(Path(self._dir, "stdout.log"), "wb") as out:  # the process has its own copy
            self._proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=self._dir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"azurite-blob exited ({self._proc.returncode}): {self.output()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"azurite-blob did not listen on {self.endpoint} in {timeout_s} s")

    def downloads(self) -> int:
        """Blob downloads (GETs of a blob, whole or a range) Azurite has served so far, as its
        debug log counts them."""
        try:
            return self.log.read_text(errors="replace").count("Operation=Blob_Download")
        except FileNotFoundError:
            return 0

    def output(self) -> str:
        return Path(self._dir, "stdout.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
