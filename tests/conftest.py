"""Shared fixtures: one local S3 server (moto over HTTP), one GCS emulator, one Azure emulator
(Azurite's blob service), each started by the first test that needs it, one Spark session per
test run, and the in-process local engine.

The S3 environment is set before Spark starts, so Spark's Python workers inherit it, as they
would from a user's shell.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.lake import write_lake

#: Set in this test session's environment: every process it starts (a benchmark's subprocess, the
#: nginx a store starts) inherits it, so the check below counts this session's processes only,
#: never another session's running beside it.
_OWNER = "LAKESHARD_TEST_SESSION"
os.environ[_OWNER] = str(os.getpid())


def _store_processes() -> set[tuple[int, str]]:
    """(pid, command line) of every process of the benchmarks' remote-like store that this test
    session started and that is alive now: its nginx (config in a ``remote-store-*`` folder) and
    its latency shim."""
    found = set()
    mark = f"{_OWNER}={os.environ[_OWNER]}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not (
                ("nginx" in cmd and "remote-store-" in cmd) or ("remote_store.py" in cmd and "--shim" in cmd)
            ):
                continue
            if mark not in Path(entry.path, "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        found.add((int(entry.name), cmd.strip()))
    return found


@pytest.fixture(autouse=True)
def _no_store_process_outlives_its_test() -> Iterator[None]:
    """Every server a test (or a benchmark it runs) starts stops when it ends: a store process
    this session started during the test and alive after it fails the test (and is killed, so
    the next test starts clean). A store of a wider fixture started before the test is not
    counted."""
    if not os.path.isdir("/proc"):
        yield
        return
    before = {pid for pid, _ in _store_processes()}
    yield
    left = [(pid, cmd) for pid, cmd in _store_processes() if pid not in before]
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"store processes outlived the test: {left}"


#: The fixtures that start a Spark session or a Dask cluster, and the engine each starts. A test that
#: uses one is ``slow`` (and marked with its engine), whether it asks for it by name, through a
#: fixture that needs it, or through ``request.getfixturevalue`` under a parametrization whose value
#: names it (``[spark]``, ``[dask_engine]``).
ENGINE_FIXTURES = {
    "spark": "spark",
    "spark_engine": "spark",
    "spark_cluster": "spark",
    "dask_client": "dask",
    "dask_engine": "dask",
    "dask_cluster": "dask",
    "dask_cli_cluster": "dask",
    "dask_engine_cli": "dask",
}


def _engines_of(item: pytest.Item) -> set[str]:
    """The engines a test starts: by the fixtures it uses, the values of its parametrization, and
    its ``spark``/``dask`` markers."""
    named = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        named |= {value for value in callspec.params.values() if isinstance(value, str)}
    engines = {ENGINE_FIXTURES[name] for name in named if name in ENGINE_FIXTURES}
    return engines | {engine for engine in ("spark", "dask") if item.get_closest_marker(engine)}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``slow`` is what needs Spark, a Dask cluster or several processes (``distributed``): those
    tests are marked here, with their engine's marker; a test that is slow for another reason
    (more than ~2 s here) carries ``@pytest.mark.slow`` itself."""
    for item in items:
        engines = _engines_of(item)
        for engine in sorted(engines):
            item.add_marker(engine)
        if engines or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a free port), with the AWS environment pointing at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(S3_ENV)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture()
def s3_bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh bucket for one test; returns ``s3://<bucket>``."""
    import boto3

    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=name)
    try:
        yield f"s3://{name}"
    finally:
        objects = client.list_objects_v2(Bucket=name).get("Contents", [])
        for obj in objects:
            client.delete_object(Bucket=name, Key=obj["Key"])
        client.delete_bucket(Bucket=name)


@pytest.fixture(scope="session")
def azurite() -> Iterator[Any]:
    """Azurite's blob service on 127.0.0.1 (a free port; tests/helpers/azurite.py), with
    ``AZURE_STORAGE_CONNECTION_STRING`` naming it (Azurite's well-known account and key)."""
    from tests.helpers.azurite import Azurite, connection_string, require_azurite

    require_azurite()
    server = Azurite().start()
    saved = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(server.endpoint)
    try:
        yield server
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("AZURE_STORAGE_CONNECTION_STRING", None)
        else:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = saved


@pytest.fixture(scope="session")
def az_endpoint(azurite: Any) -> str:
    """The endpoint of :func:`azurite`: ``http://127.0.0.1:<port>``."""
    return str(azurite.endpoint)


@pytest.fixture()
def az_container(az_endpoint: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh container for one test; returns ``az://<container>``."""
    from lakeshard.storage import azure_client

    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    name = "-".join(p for p in name.split("-") if p)  # no two dashes in a row, as Azure asks
    container = azure_client().create_container(name)
    try:
        yield f"az://{name}"
    finally:
        container.delete_container()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[Any]:
    """gcp-storage-emulator on 127.0.0.1 (a free port, in memory; with the JSON API's generation
    preconditions added: tests/helpers/gcs_emulator.py), the Google environment pointing at it."""
    from lakeshard.storage import clear_gcs_clients
    from tests.helpers.gcs_emulator import start_emulator

    emulator = start_emulator()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT")}
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.endpoint
    os.environ["GOOGLE_CLOUD_PROJECT"] = "lakeshard-tests"
    try:
        yield emulator
    finally:
        emulator.stop()
        clear_gcs_clients()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture()
def gcs_bucket(gcs_emulator: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh bucket of the GCS emulator for one test; returns ``gs://<bucket>``."""
    from lakeshard.storage import gcs_client

    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    bucket = gcs_client().create_bucket(name)
    try:
        yield f"gs://{name}"
    finally:
        for blob in gcs_client().list_blobs(name):
            blob.delete()
        bucket.delete()


@pytest.fixture(scope="session")
def spark(s3_endpoint: str):
    """One local[2] Spark session for the whole run (it takes 10-17 s to start here)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from jobs.common.engines.spark_engine import SparkEngine

    engine = SparkEngine(master="local[2]", app_name="lakeshard-tests")
    yield engine.spark
    engine.spark.stop()


@pytest.fixture()
def spark_engine(spark):
    from jobs.common.engines.spark_engine import SparkEngine

    return SparkEngine(spark=spark)


@pytest.fixture(scope="session")
def dask_client(s3_endpoint: str) -> Iterator[Any]:
    """A LocalCluster of two worker processes, one thread each (as the engine starts its own),
    started after the S3 environment is set so its workers inherit it."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


@pytest.fixture()
def dask_engine(dask_client):
    from jobs.common.engines.dask_engine import DaskEngine

    return DaskEngine(client=dask_client)


@pytest.fixture()
def local_engine():
    """The in-process engine (a thread pool): for tests of the engine-free core."""
    from jobs.common.engines.local_engine import LocalEngine

    return LocalEngine(workers=2)


@pytest.fixture()
def small_lake(tmp_path: Path) -> Path:
    """A local lake of three classes of small PNGs, some one folder deeper."""
    root = tmp_path / "raw"
    write_lake(root, {"cat": 40, "dog": 30, "fox": 20})
    return root
