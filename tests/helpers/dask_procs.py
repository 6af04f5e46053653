"""A Dask cluster for tests as users run one: ``dask scheduler`` and ``dask worker`` processes on
127.0.0.1 (with TLS when given certificates), stopped at the end: the loader's preparation
cluster (``--no-nanny`` workers) and the jobs' clusters (tests/hardening, tests/jobs/engines)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.procs import wait_for

_REPO = Path(__file__).resolve().parents[2]

__all__ = ["DaskProcs", "TlsFiles", "dask_procs", "make_tls_files", "warm"]

DASK = str(Path(sys.executable).parent / "dask")


@dataclass(frozen=True)
class TlsFiles:
    """A CA and one certificate (for 127.0.0.1 and localhost) signed by it, as PEM files."""

    ca_file: str
    cert: str
    key: str

    def cli(self) -> list[str]:
        return ["--tls-ca-file", self.ca_file, "--tls-cert", self.cert, "--tls-key", self.key]


def make_tls_files(root: Path, name: str = "ca") -> TlsFiles:
    """A new CA under ``root/name`` and a certificate it signed for 127.0.0.1 and localhost (server
    and client use), made with the ``cryptography`` package."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"lakeshard test {name}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = TlsFiles(str(folder / "ca.pem"), str(folder / "cert.pem"), str(folder / "key.pem"))
    Path(files.ca_file).write_bytes(ca.public_bytes(pem))
    Path(files.cert).write_bytes(cert.public_bytes(pem))
    Path(files.key).write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files


@dataclass
class DaskProcs:
    """A running cluster: its scheduler's address, its processes and their log files."""

    address: str
    scheduler: subprocess.Popen
    tls: TlsFiles | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs)

    def batches_made(self) -> int:
        """Batch tasks (``lakeshard-batch-...``) whose result the cluster made, as its scheduler
        counts them."""
        with _client(self.address, self.tls) as client:
            return client.run_on_scheduler(_batches_made)

    def kill(self) -> None:
        """SIGKILL the scheduler and the workers (a cluster that goes away at once)."""
        for proc in (self.scheduler, *self.workers):
            _stop(proc, signal.SIGKILL)


@contextmanager
def dask_procs(
    root: Path,
    *,
    workers: int = 1,
    threads: int = 1,
    nanny: bool = False,
    name: str = "prep",
    tls: TlsFiles | None = None,
    env: Mapping[str, str] | None = None,
    worker_env: Mapping[str, str] | None = None,
    warm_loader: bool = True,
) -> Iterator[DaskProcs]:
    """``dask scheduler`` and ``workers`` ``dask worker`` processes (``threads`` threads each,
    named ``{name}-{i}``; ``--no-nanny`` unless ``nanny``) on 127.0.0.1, logging to files in
    ``root``, their working folder; with ``tls`` all of them talk TLS with those certificates.
    ``env`` is every process's environment (this process's when not given; either way without
    ``DASK_SCHEDULER_ADDRESS`` and with this checkout on ``PYTHONPATH``); ``worker_env`` is
    added to the workers' (``PYTHONPATH``, say). ``warm_loader``: the workers import the
    loader's decode path before the cluster is yielded (:func:`warm`)."""
    root.mkdir(parents=True, exist_ok=True)
    file = root / "scheduler.json"
    tls_args = tls.cli() if tls else []
    base = dict(os.environ if env is None else env)
    base.pop("DASK_SCHEDULER_ADDRESS", None)
    # The cluster has this checkout's code, tests included (functions of tests.helpers run on the
    # scheduler and the workers), as a deployment has the trainer's code on its workers.
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), base.get("PYTHONPATH", "")) if p)

    def start(log_name: str, args: list[str], extra: Mapping[str, str] | None = None) -> subprocess.Popen:
        log = root / f"{log_name}.log"
        logs.append(log)
        with open(log, "wb") as out:
            return subprocess.Popen(
                [DASK, *args, *tls_args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**base, **(extra or {})},
                cwd=root,
                start_new_session=True,
            )

    logs: list[Path] = []
    protocol = ["--protocol", "tls"] if tls else []
    command = "scheduler --host 127.0.0.1 --port 0 --no-dashboard --scheduler-file".split()
    scheduler = start("scheduler", [*command, str(file), *protocol])
    cluster = DaskProcs("", scheduler, tls, logs=logs)
    try:
        cluster.address = wait_for(
            lambda: file.exists() and json.loads(file.read_text() or "{}").get("address"),
            "dask scheduler",
            90,
            logs,
        )
        for i in range(workers):
            args = ["worker", cluster.address, "--nthreads", str(threads), "--host", "127.0.0.1"]
            args += [] if nanny else ["--no-nanny"]
            args += ["--no-dashboard", "--name", f"{name}-{i}", "--local-directory", str(root / f"w{i}")]
            cluster.workers.append(start(f"worker-{i}", args, worker_env))
        wait_for(
            lambda: sum("Registered to:" in p.read_text(errors="replace") for p in logs[1:]) == workers,
            "dask workers",
            120,
            logs,
        )
        if warm_loader:
            warm(cluster.address, tls)
        yield cluster
    finally:
        for proc in reversed([scheduler, *cluster.workers]):
            _stop(proc, signal.SIGTERM)


def _client(address: str, tls: TlsFiles | None) -> Any:
    from distributed import Client
    from distributed.security import Security

    security = None
    if tls:
        security = Security(
            tls_ca_file=tls.ca_file, tls_client_cert=tls.cert, tls_client_key=tls.key, require_encryption=True
        )
    return Client(address, timeout=60, security=security, set_as_default=False)


def warm(address: str, tls: TlsFiles | None = None) -> None:
    """Each worker imports the loader's decode path now (torch: seconds on a busy machine), so
    that a test's first batch is not timed against it."""
    with _client(address, tls) as client:
        # importlib's function goes by reference: the workers need nothing of this test package.
        client.run(importlib.import_module, "loaders._internal.prep")


def _batches_made(dask_scheduler: Any) -> int:
    prefix = dask_scheduler.task_prefixes.get("lakeshard-batch")
    return 0 if prefix is None else prefix.state_counts["memory"]


def _stop(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """``sig`` to the process group we started, then SIGKILL if it has not ended in 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
