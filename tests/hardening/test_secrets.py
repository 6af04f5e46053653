"""Credentials never leak: both jobs run as subprocesses (``spark-submit --verbose`` with an
event log, and ``python -m`` on the shared Dask cluster) with credentials in the environment
against an S3 lake; every log line, the Spark event log, the dask scheduler and worker logs,
and every object the jobs wrote (manifests, shards, report.html, dataset.json) are searched
for the secret key and the key id. On GCS, the jobs and the loader read a service account's key
file (``GOOGLE_APPLICATION_CREDENTIALS``, Google's standard chain), trade it for an access token
at a token endpoint of the test's, and send it to the emulator: neither the key nor the token is
in a log or an output."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest

from lakeshard import storage
from tests.hardening.conftest import SECRET_KEY, SECRET_KEY_ID, secret_env
from tests.hardening.helpers import BIN, REPO, job_env
from tests.helpers.lake import write_lake

pytestmark = pytest.mark.slow

SECRETS = [s.encode() for s in (SECRET_KEY, SECRET_KEY_ID)]


def _run(cmd: list[str], env: dict[str, str], log: Path) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=400)
    log.write_bytes(proc.stdout + b"\n--- stderr\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:].decode(errors="replace")


@pytest.mark.s3
@pytest.mark.spark
@pytest.mark.dask
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


@pytest.fixture()
def google_key_file(tmp_path: Path) -> Iterator[tuple[Path, list[bytes], list[int]]]:
    """A service account's key file whose token endpoint is a server of this test's (on
    127.0.0.1): the key file, its secrets (the private key, its id, the access token given for
    it) and the count of tokens given."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    token, given = "ya29.hardening-Access-Token-4242", [0]

    class Tokens(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps({"access_token": token, "expires_in": 3600, "token_type": "Bearer"}).encode()
            given[0] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Tokens)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        .decode()
    )
    key = {
        "type": "service_account",
        "project_id": "lakeshard-tests",
        "private_key_id": "hardeningKeyId4242abcdef",
        "private_key": pem,
        "client_email": "hardening@lakeshard-tests.iam.gserviceaccount.com",
        "client_id": "4242",
        "token_uri": f"http://127.0.0.1:{server.server_address[1]}/token",
    }
    path = tmp_path / "key.json"
    path.write_text(json.dumps(key))
    body = pem.split("-----")[2].strip().splitlines()[3]  # a line from inside the key
    try:
        yield path, [token.encode(), key["private_key_id"].encode(), body.encode()], given
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.gcs
@pytest.mark.timeout(600)
def test_no_google_credentials_in_logs_or_outputs(
    gcs_bucket: str, google_key_file: tuple[Path, list[bytes], list[int]], tmp_path: Path
):
    key_file, secrets, given = google_key_file
    local = tmp_path / "lake"
    write_lake(local, {"a": 10, "b": 10})
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes_atomic(f"{gcs_bucket}/raw/{p.relative_to(local).as_posix()}", p.read_bytes())
    env = job_env(GOOGLE_APPLICATION_CREDENTIALS=str(key_file))
    logs = tmp_path / "logs"
    logs.mkdir()
    out = f"{gcs_bucket}/ds"
    local_engine = ["--engine", "local"]
    manifest = ["--input", f"{gcs_bucket}/raw", "--output", out, "--split-method", "stratified"]
    _run([sys.executable, "-m", "jobs.manifest", *local_engine, *manifest], env, logs / "manifest.log")
    shard = ["--dataset", out, "--num-shards", "2", "--image-size", "16"]
    _run([sys.executable, "-m", "jobs.shard", *local_engine, *shard], env, logs / "shard.log")
    read = (
        f"from loaders import ShardLoader; print(sum(len(y) for _, y in ShardLoader({out!r}, batch_size=4)))"
    )
    _run([sys.executable, "-c", read], env, logs / "loader.log")
    assert given[0] >= 3  # each process traded the key for a token: the chain was used

    fs = storage.store_for(out).filesystem()
    searched = {str(p): p.read_bytes() for p in logs.iterdir()}
    searched.update({f"gs://{k}": fs.cat_file(k) for k in fs.find(storage.store_for(out).path(out))})
    assert any(k.endswith("dataset.json") for k in searched) and len(searched) > 10
    leaks = [(where, s.decode()) for where, data in searched.items() for s in secrets if s in data]
    assert not leaks, f"credentials found in: {leaks}"
