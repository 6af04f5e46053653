"""Azurite, the Azure Blob Storage emulator (the npm package ``azurite``,
``scripts/setup_azurite.sh``): its blob service on a free port of 127.0.0.1, in memory, for the
``az://`` tests (tests/helpers/azurite.py) and ``remote_bench.py --store azure`` (which puts the
latency shim of ``remote_store.py`` in front of it, as in front of the GCS emulator:
``RemoteStore(upstream=...)``).

```python
azurite = Azurite().start()
os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(azurite.endpoint)
...
azurite.stop()
```

The account is Azurite's well-known ``devstoreaccount1``, whose key is public (Azurite's
documentation): for emulators only.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

__all__ = [
    "ACCOUNT",
    "ACCOUNT_KEY",
    "Azurite",
    "AzuriteMissingError",
    "connection_string",
    "find_azurite",
    "installed_azurite",
]

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def installed_azurite(folder: str = "azurite") -> Path:
    """The ``azurite-blob`` scripts/setup_azurite.sh installs into ``.tools/<folder>``."""
    return Path(__file__).resolve().parents[1] / ".tools" / folder / "node_modules" / ".bin" / "azurite-blob"


_INSTALLED = installed_azurite()
_START_TIMEOUT_S = 120.0


class AzuriteMissingError(RuntimeError):
    """Azurite is not installed."""


def find_azurite() -> str:
    """The ``azurite-blob`` command: ``LAKESHARD_AZURITE``, scripts/setup_azurite.sh's, or on PATH."""
    for candidate in (os.environ.get("LAKESHARD_AZURITE"), str(_INSTALLED), shutil.which("azurite-blob")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise AzuriteMissingError(
        "Azurite is not installed: run `bash scripts/setup_azurite.sh` (npm install of azurite into "
        ".tools/azurite), or set LAKESHARD_AZURITE to an azurite-blob command"
    )


def connection_string(endpoint: str) -> str:
    """A connection string for ``devstoreaccount1`` at ``endpoint`` (``http://host:port``)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Azurite:
    """One ``azurite-blob`` process, in memory, on a free port of 127.0.0.1; ``endpoint`` is
    ``http://127.0.0.1:<port>``; ``log`` its debug log (every request it served)."""

    def __init__(self, command: str | None = None) -> None:
        self._command = command  # an ``azurite-blob``; None: :func:`find_azurite`'s
        self._dir = tempfile.mkdtemp(prefix="azurite-")
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = Path(self._dir, "debug.log")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> Azurite:
        command = [self._command or find_azurite(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port)]
        command += ["--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry"]
        command += ["--debug", str(self.log)]
        with open(Path(self._dir, "stdout.log"), "wb") as out:  # the process has its own copy
            self._proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=self._dir, start_new_session=True
            )
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

    @property
    def pid(self) -> int | None:
        """The ``azurite-blob`` process (None before :meth:`start`)."""
        return None if self._proc is None else self._proc.pid

    def downloads(self) -> int:
        """Blob downloads (GETs of a blob, whole or a range) served so far, by its debug log."""
        return self.served_log().count("Operation=Blob_Download")

    def served_log(self, timeout_s: float = 30.0) -> str:
        """The debug log with every request answered before this call in it. Azurite writes
        the log behind its answers, so the last lines can be missing from the file when a
        client already has its answer: this sends one more request (a container's properties,
        unsigned: refused, but logged) and reads until its line is there."""
        mark = f"lakeshard-log-mark-{uuid.uuid4().hex}"
        try:
            urllib.request.urlopen(f"{self.endpoint}/{ACCOUNT}/{mark}?restype=container", timeout=timeout_s)
        except urllib.error.HTTPError:
            pass  # 403: unsigned
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            if mark in text:
                return text
            if time.monotonic() > deadline:
                raise RuntimeError(f"azurite-blob's log ({self.log}) did not show a request in {timeout_s} s")
            time.sleep(0.02)

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
