"""Fixtures of the hardening tests: a ``dask scheduler`` + ``dask worker`` started once and
reused by every job subprocess, a fault-injecting proxy in front of the moto server, and
credentials distinctive enough to grep for. Every process is started on 127.0.0.1 and stopped
by the PID (process group) it was started with."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.faultproxy import FaultProxy
from tests.hardening.helpers import BIN, job_env, kill_group
from tests.helpers.procs import wait_for

#: Credentials of the job subprocesses and the dask workers (moto accepts any): distinctive,
#: so the secrets test can grep every output for them.
SECRET_KEY_ID = "AKIAHARDENINGKEY4242"
SECRET_KEY = "hardening+Secret/Key4242xyzzy"


def secret_env(**extra: str) -> dict[str, str]:
    return job_env(AWS_ACCESS_KEY_ID=SECRET_KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET_KEY, **extra)


class DaskCluster:
    def __init__(self, address: str, logs: list[Path]) -> None:
        self.address = address
        self.logs = logs


@pytest.fixture(scope="session")
def dask_cluster(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskCluster]:
    """``dask scheduler`` and one ``dask worker`` (2 threads), with the S3 environment and the
    hardening credentials; every job subprocess connects with ``--scheduler``."""
    root = tmp_path_factory.mktemp("hardening-dask")
    scheduler_file = root / "scheduler.json"
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    env = secret_env()

    def start(name: str, *args: str) -> None:
        log = root / f"{name}.log"
        logs.append(log)
        with open(log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    [str(BIN / "dask"), *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=root,
                    start_new_session=True,
                )
            )

    try:
        start(
            "scheduler",
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(scheduler_file),
        )
        address = wait_for(
            lambda: scheduler_file.exists() and json.loads(scheduler_file.read_text() or "{}").get("address"),
            "dask scheduler",
            90,
            logs,
        )
        start(
            "worker",
            "worker",
            address,
            "--host",
            "127.0.0.1",
            "--nthreads",
            "2",
            "--nworkers",
            "1",
            "--no-dashboard",
            "--name",
            "hardening-0",
            "--local-directory",
            str(root / "w0"),
        )
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=90)
        yield DaskCluster(address, logs)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    kill_group(proc)


@pytest.fixture()
def dask_engine_cli(dask_cluster: DaskCluster):
    """A DaskEngine in this process on the shared CLI cluster (built after the test set its
    environment: the engine forwards AWS_ENDPOINT_URL to the workers as it is at construction)."""
    from distributed import Client

    from jobs.common.engines.dask_engine import DaskEngine

    clients = []

    def make() -> DaskEngine:
        client = Client(dask_cluster.address, timeout=60)
        clients.append(client)
        return DaskEngine(client=client)

    yield make
    for c in clients:
        c.close()


@pytest.fixture(scope="session")
def fault_proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture()
def s3_via(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    """``s3_via(endpoint)`` points this process's S3 clients (and engines built afterwards) at
    ``endpoint``; the environment is restored after the test."""

    def point(endpoint: str) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    return point
