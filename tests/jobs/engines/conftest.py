"""Fixtures for the engine tests: one lake with bad objects, the reference dataset written by
Spark in local mode, a Dask LocalCluster, and real clusters (a Dask scheduler with two workers
started by the ``dask`` CLI; a Spark standalone master and worker started by
``spark-daemon.sh``), all on 127.0.0.1, each stopped by the PIDs it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from tests.helpers.dask_procs import dask_procs
from tests.helpers.lake import bad_objects, write_lake
from tests.helpers.procs import free_port, wait_for

REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent

#: The job options every engine test uses: stratified (every class in every channel of a small
#: lake), a reject budget the bad objects fit in, ``pad`` so some rows are routed twice, and
#: listing tasks of 16 objects, so every engine lists the classes in pieces over several rounds.
MANIFEST_OPTS: dict[str, Any] = {
    "split_method": "stratified",
    "seed": 7,
    "max_reject_fraction": 0.2,
    "list_task_objects": 16,
}
SHARD_OPTS: dict[str, Any] = {
    "num_shards": 3,
    "image_size": 32,
    "remainder": "pad",
    "max_reject_fraction": 0.2,
}


def cli_args(opts: dict[str, Any]) -> list[str]:
    return [a for k, v in opts.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def build_dataset(engine: Any, lake: str, out: str) -> str:
    """Run the manifest and shard jobs in this process on ``engine``; return ``out``."""
    manifest_job.run(ManifestConfig(input=lake, output=out, engine=engine.name, **MANIFEST_OPTS), engine)
    shard_job.run(ShardConfig(dataset=out, engine=engine.name, **SHARD_OPTS), engine)
    return out


def job_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return env


def run_job(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """Run a job command line; fail with its output if it fails. ``timeout`` only stops a hang:
    a ``spark-submit`` to the standalone cluster took over 240 s on a busy machine (CI)."""
    proc = subprocess.run(
        cmd, cwd=REPO, env=env or job_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


@pytest.fixture(scope="session")
def mixed_lake(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three classes of small PNGs plus a fourth of awkward and bad objects
    (:func:`tests.helpers.lake.bad_objects`)."""
    root = tmp_path_factory.mktemp("engines") / "raw"
    write_lake(root, {"cat": 40, "dog": 30, "fox": 20})
    for key, data in bad_objects().items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return str(root)


@pytest.fixture(scope="session")
def spark_reference(spark, mixed_lake: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The dataset Spark writes from ``mixed_lake`` in local mode: what every other run must equal."""
    from jobs.common.engines.spark_engine import SparkEngine

    return build_dataset(
        SparkEngine(spark=spark), mixed_lake, str(tmp_path_factory.mktemp("spark-local") / "ds")
    )


@pytest.fixture(scope="module")
def dask_cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``dask scheduler`` and two ``dask worker`` processes on 127.0.0.1; yields the address."""
    root = tmp_path_factory.mktemp("dask-cluster")
    with dask_procs(
        root, workers=2, nanny=True, name="lakeshard-test", env=job_env(), warm_loader=False
    ) as cluster:
        yield cluster.address


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark standalone master and one worker (2 cores, 2 GiB) from pip's pyspark, on
    127.0.0.1; yields the master URL. Logs, PIDs and work dirs stay in a temporary folder."""
    import pyspark

    home = Path(pyspark.__file__).parent
    root = tmp_path_factory.mktemp("spark-cluster")
    env = job_env(
        SPARK_HOME=str(home),
        SPARK_LOG_DIR=str(root / "logs"),
        SPARK_PID_DIR=str(root / "pids"),
        SPARK_WORKER_DIR=str(root / "work"),
        SPARK_IDENT_STRING="lakeshard-tests",
        # No REST submission server: its fixed port (6066) would clash across runs.
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
    )
    daemon = str(home / "sbin" / "spark-daemon.sh")
    master, worker = "org.apache.spark.deploy.master.Master", "org.apache.spark.deploy.worker.Worker"
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    logs = root / "logs"

    def log_text(cls: str) -> str:
        return "".join(p.read_text(errors="replace") for p in logs.glob(f"*{cls}*.out"))

    try:
        subprocess.run(
            [
                daemon,
                "start",
                master,
                "1",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(free_port()),
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(lambda: "ALIVE" in log_text(master), "spark master", 90, list(logs.glob("*")))
        subprocess.run(
            [
                daemon,
                "start",
                worker,
                "1",
                url,
                "--host",
                "127.0.0.1",
                "--cores",
                "2",
                "--memory",
                "2g",
                "--webui-port",
                str(free_port()),
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(lambda: "Registering worker" in log_text(master), "spark worker", 90, list(logs.glob("*")))
        yield url
    finally:
        for cls in (worker, master):
            subprocess.run([daemon, "stop", cls, "1"], env=env, capture_output=True, timeout=60)
        for pid_file in (root / "pids").glob("*.pid"):  # whatever the stop script left running
            pid = pid_file.read_text().strip()
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone
            if str(root).encode() in cmdline or b"org.apache.spark.deploy" in cmdline:
                os.kill(int(pid), signal.SIGKILL)
