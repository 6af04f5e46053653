"""The remote-like settings in front of a store emulator: Azurite's blob service (the npm package
``azurite``, ``scripts/setup_azurite.sh``) on 127.0.0.1, behind the latency shim of
``remote_store.py`` run as a pass-through (each answer ``latency_ms`` late, at ``bandwidth`` a
connection, nothing rewritten).

```python
with AzuriteStore(latency_ms=20, bandwidth=80e6) as store:
    store.upload(Path("/tmp/ds-root/ds"), "ds")   # az://bench/ds, straight to Azurite
    os.environ.update(store.environ())            # the connection string names the shim
    loader = ShardLoader(store.uri("ds"), ...)
    before = store.traffic()
```

:class:`Azurite` alone (no shim) is what the tests start (tests/helpers/azurite.py). The
account is Azurite's well-known ``devstoreaccount1``, whose key is public (Azurite's
documentation): for emulators only.
"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from remote_store import StoreProcesses, Traffic, start_shim, stop_group

__all__ = ["ACCOUNT", "ACCOUNT_KEY", "Azurite", "AzuriteMissingError", "AzuriteStore", "connection_string"]

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_INSTALLED = (
    Path(__file__).resolve().parents[1] / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
)
_START_TIMEOUT_S = 120.0
_SETTLE_S = 2.0


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

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="azurite-")
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = Path(self._dir, "debug.log")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> Azurite:
        command = [find_azurite(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port)]
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

    def downloads(self) -> int:
        """Blob downloads (GETs of a blob, whole or a range) served so far, by its debug log."""
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


class AzuriteStore(StoreProcesses):
    """Azurite behind the pass-through latency shim: ``az://<container>/...`` at
    :attr:`endpoint`. A context manager, as ``remote_store.RemoteStore``, with the same
    :meth:`uri`, :meth:`environ`, :meth:`traffic`, :meth:`served` and :attr:`pids`."""

    def __init__(
        self, *, container: str = "bench", latency_ms: float = 20.0, bandwidth: int = 80_000_000
    ) -> None:
        self.container, self.latency_ms, self.bandwidth = container, latency_ms, bandwidth
        self.azurite: Azurite | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._shim: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self) -> AzuriteStore:
        self._tmp = tempfile.TemporaryDirectory(prefix="remote-store-azurite-")
        atexit.register(self.stop)
        try:
            self.azurite = Azurite().start()
            self._shim, self.endpoint = start_shim(
                Path(self._tmp.name),
                upstream=self.azurite.port,
                latency_ms=self.latency_ms,
                bandwidth=self.bandwidth,
                log=Path(self._tmp.name, "shim.log"),
                passthrough=True,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._shim is not None:
            stop_group(self._shim)
            self._shim = None
        if self.azurite is not None:
            self.azurite.stop()
            self.azurite = None
        self._forget()

    @property
    def pids(self) -> list[int]:
        procs = [self._shim, getattr(self.azurite, "_proc", None)]
        return [p.pid for p in procs if p is not None]

    def uri(self, key: str = "") -> str:
        return f"az://{self.container}/{key.strip('/')}".rstrip("/")

    def environ(self) -> dict[str, str]:
        """The Azure environment that points the clients at the shim."""
        return {"AZURE_STORAGE_CONNECTION_STRING": connection_string(self.endpoint)}

    def upload(self, folder: Path, key: str) -> str:
        """Copy ``folder`` to ``az://<container>/<key>`` straight to Azurite (not through the
        shim: no traffic counted); its URI."""
        from azure.storage.blob import BlobServiceClient

        if self.azurite is None:
            raise RuntimeError("the store is not running")
        client = BlobServiceClient.from_connection_string(connection_string(self.azurite.endpoint))
        container = client.get_container_client(self.container)
        if not container.exists():
            container.create_container()
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                container.upload_blob(
                    f"{key}/{p.relative_to(folder).as_posix()}", p.read_bytes(), overwrite=True
                )
        return self.uri(key)

    def _log(self) -> list[str]:
        if self._tmp is None:
            raise RuntimeError("the store is not running")
        return Path(self._tmp.name, "shim.log").read_text().splitlines()

    def served(self, *, since: int = 0) -> list[str]:
        """The shim's log of the answers relayed, one line each from the ``since``-th
        (``GET <status> <body bytes> <path> <range>``)."""
        lines = [line.split(" ", 1)[1] for line in self._log() if line.startswith("served ")]
        return lines[since:]

    def traffic(self, *, settle_s: float = _SETTLE_S) -> Traffic:
        """Everything relayed since :meth:`start`, once each forwarded request's answer is logged
        (waiting at most ``settle_s``). ``bytes_sent`` counts bodies only (no headers)."""
        deadline = time.monotonic() + settle_s
        while True:
            log = self._log()
            kinds = collections.Counter(" ".join(line.split()[:2]) for line in log)
            forwarded = sum(n for k, n in kinds.items() if k.startswith("forward "))
            served = [line.split() for line in log if line.startswith("served ")]
            if len(served) >= forwarded or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        lists = sum(1 for line in log if line.startswith("forward GET") and "comp=list" in line)
        body = sum(int(f[3]) for f in served)
        gets, heads = kinds["forward GET"] - lists, kinds["forward HEAD"]
        return Traffic(
            requests=forwarded,
            gets=gets,
            heads=heads,
            lists=lists,
            other=forwarded - gets - heads - lists,
            connections=kinds["connect"],
            body_bytes=body,
            bytes_sent=body,
        )
