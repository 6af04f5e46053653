"""Azure credentials never leak (as tests/hardening/test_secrets.py holds for S3): both jobs run
as subprocesses (``python -m``, the local engine) with the account key in the environment's
connection string against an Azure lake (Azurite); every log line, the message of a job that
fails, and every blob the jobs wrote (manifests, shards, report.html, dataset.json) are searched
for the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lakeshard import storage
from tests.hardening.helpers import REPO, job_env
from tests.helpers.azurite import ACCOUNT_KEY
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.azure, pytest.mark.slow]

#: The key, and the half of it a message cut short might hold.
SECRETS = [ACCOUNT_KEY.encode(), ACCOUNT_KEY[: len(ACCOUNT_KEY) // 2].encode()]


def _run(args: list[str], log: Path, *, ok: bool = True) -> None:
    env = job_env(AZURE_STORAGE_CONNECTION_STRING=os.environ["AZURE_STORAGE_CONNECTION_STRING"])
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, timeout=400)
    log.write_bytes(proc.stdout + b"\n--- stderr\n" + proc.stderr)
    assert (proc.returncode == 0) == ok, proc.stderr[-3000:].decode(errors="replace")


@pytest.mark.timeout(600)
def test_no_azure_credentials_in_logs_errors_or_outputs(az_container: str, tmp_path: Path):
    local = tmp_path / "lake"
    write_lake(local, {"a": 10, "b": 10})
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes_atomic(
                f"{az_container}/raw/{p.relative_to(local).as_posix()}", p.read_bytes()
            )
    out = f"{az_container}/ds"
    logs = tmp_path / "logs"
    logs.mkdir()
    local_engine = ["--engine", "local"]
    common = ["--split-method", "stratified", "--seed", "7"]
    _run(
        ["jobs.manifest", *local_engine, "--input", f"{az_container}/raw", "--output", out, *common],
        logs / "manifest.log",
    )
    _run(
        ["jobs.shard", *local_engine, "--dataset", out, "--num-shards", "2", "--image-size", "16"],
        logs / "shard.log",
    )
    _run(
        ["jobs.manifest", *local_engine, "--input", "az://no-such-container/raw", "--output", f"{out}2"],
        logs / "failed.log",
        ok=False,
    )
    assert "az://no-such-container/raw" in (logs / "failed.log").read_text()

    searched = {str(p): p.read_bytes() for p in logs.iterdir()}
    fs, path = storage.filesystem(out)
    written = fs.find(path)
    kinds = {w.rsplit("/", 1)[-1].split("-")[0] for w in written}
    assert {"dataset.json", "report.html", "_manifest.json", "part"} <= kinds, kinds
    searched.update({w: fs.cat_file(w) for w in written})
    leaks = [(where, s.decode()) for where, data in searched.items() for s in SECRETS if s in data]
    assert not leaks, f"credentials found in: {leaks}"
    assert len(searched) > 10
