"""Credentials never leak: both jobs run as subprocesses (``spark-submit --verbose`` with an
event log, and ``python -m`` on the shared Dask cluster) with credentials in the environment
against an S3 lake; every log line, the Spark event log, the dask scheduler and worker logs,
and every object the jobs wrote (manifests, shards, report.html, dataset.json) are searched
for the secret key and the key id."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from tests.hardening.conftest import SECRET_KEY, SECRET_KEY_ID, secret_env
from tests.hardening.helpers import BIN, REPO
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.spark, pytest.mark.dask]

SECRETS = [s.encode() for s in (SECRET_KEY, SECRET_KEY_ID)]


def _run(cmd: list[str], env: dict[str, str], log: Path) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=400)
    log.write_bytes(proc.stdout + b"\n--- stderr\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:].decode(errors="replace")


@pytest.mark.timeout(600)
def test_no_credentials_in_logs_or_outputs(s3_bucket, dask_cluster, tmp_path: Path):
    local = tmp_path / "lake"
    write_lake(local, {"a": 10, "b": 10})
    name = s3_bucket[len("s3://") :]
    client = boto3.client("s3")
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.put_object(Bucket=name, Key=f"raw/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    lake = f"{s3_bucket}/raw"
    env = secret_env(PYSPARK_PYTHON=sys.executable)
    events = tmp_path / "events"
    events.mkdir()
    submit = [
        str(BIN / "spark-submit"),
        "--master",
        "local[1]",
        "--verbose",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.eventLog.enabled=true",
        "--conf",
        "spark.eventLog.compress=false",
        "--conf",
        f"spark.eventLog.dir=file://{events}",
    ]
    logs = tmp_path / "logs"
    logs.mkdir()
    common = ["--split-method", "stratified", "--seed", "7"]
    _run(
        [*submit, "jobs/manifest.py", "--input", lake, "--output", f"{s3_bucket}/spark", *common],
        env,
        logs / "spark-manifest.log",
    )
    _run(
        [
            *submit,
            "jobs/shard.py",
            "--dataset",
            f"{s3_bucket}/spark",
            "--num-shards",
            "2",
            "--image-size",
            "16",
        ],
        env,
        logs / "spark-shard.log",
    )
    dask = ["--engine", "dask", "--scheduler", dask_cluster.address]
    _run(
        [
            sys.executable,
            "-m",
            "jobs.manifest",
            *dask,
            "--input",
            lake,
            "--output",
            f"{s3_bucket}/dask",
            *common,
        ],
        env,
        logs / "dask-manifest.log",
    )
    _run(
        [
            sys.executable,
            "-m",
            "jobs.shard",
            *dask,
            "--dataset",
            f"{s3_bucket}/dask",
            "--num-shards",
            "2",
            "--image-size",
            "16",
        ],
        env,
        logs / "dask-shard.log",
    )

    searched: dict[str, bytes] = {
        str(p): p.read_bytes() for p in [*logs.iterdir(), *events.rglob("*")] if p.is_file()
    }
    searched.update({str(p): p.read_bytes() for p in dask_cluster.logs})
    outputs = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name)
        for o in page.get("Contents", [])
        if not o["Key"].startswith("raw/")
    ]
    for key in outputs:
        searched[f"s3://{name}/{key}"] = client.get_object(Bucket=name, Key=key)["Body"].read()
    kinds = {k.rsplit("/", 1)[-1].split("-")[0] for k in outputs}
    assert {"dataset.json", "report.html", "_manifest.json", "part"} <= kinds, kinds
    assert any("/manifests/all/part-" in k for k in outputs), outputs
    assert any(b"SparkListenerEnvironmentUpdate" in v for v in searched.values()), "no Spark event log"
    assert all(b"Exception" not in v or b"Traceback" not in v for k, v in searched.items() if "logs" in k)
    leaks = [(where, s.decode()) for where, data in searched.items() for s in SECRETS if s in data]
    assert not leaks, f"credentials found in: {leaks}"
    assert len(searched) > 20
