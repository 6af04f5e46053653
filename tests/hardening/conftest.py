"""Fixtures of the hardening tests: a ``dask scheduler`` + ``dask worker`` started once and
reused by every job subprocess, a fault-injecting proxy in front of the moto server, and
credentials distinctive enough to grep for. Every process is started on 127.0.0.1 and stopped
by the PID (process group) it was started with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hardening.faultproxy import FaultProxy
from tests.hardening.helpers import job_env
from tests.helpers.dask_procs import DaskProcs, dask_procs

#: Credentials of the job subprocesses and the dask workers (moto accepts any): distinctive,
#: so the secrets test can grep every output for them.
SECRET_KEY_ID = "AKIAHARDENINGKEY4242"
SECRET_KEY = "hardening+Secret/Key4242xyzzy"


def secret_env(**extra: str) -> dict[str, str]:
    return job_env(AWS_ACCESS_KEY_ID=SECRET_KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET_KEY, **extra)


@pytest.fixture(scope="session")
def dask_cluster(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskProcs]:
    """``dask scheduler`` and one ``dask worker`` (2 threads), with the S3 environment and the
    hardening credentials; every job subprocess connects with ``--scheduler``."""
    root = tmp_path_factory.mktemp("hardening-dask")
    with dask_procs(
        root, threads=2, nanny=True, name="hardening", env=secret_env(), warm_loader=False
    ) as cluster:
        yield cluster


@pytest.fixture()
def dask_engine_cli(dask_cluster: DaskProcs):
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
def az_fault_proxy(az_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of Azurite, answering Azure's errors, with this process's
    Azure clients pointed at it (the environment is restored after the test)."""
    from tests.helpers.azurite import connection_string

    proxy = FaultProxy(az_endpoint, dialect="azure").start()
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(proxy.endpoint))
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
