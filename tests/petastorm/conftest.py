"""Fixtures of the petastorm tests, which run in ``.venv-petastorm`` (``scripts/setup_petastorm.sh``):

    .venv-petastorm/bin/python -m pytest tests/petastorm -p no:cacheprovider

The shards must be written by our jobs, which need the main environment (pyspark 4.1, pyarrow
26), so the dataset is built by running the jobs with the main environment's Python in
subprocesses. The main run leaves this folder out (``--ignore=tests/petastorm``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.lake import write_lake

REPO = Path(__file__).resolve().parents[2]


def main_python() -> Path:
    """The main environment's interpreter: ``$LAKESHARD_MAIN_PYTHON``, else ``<repo>/.venv/bin/python``."""
    path = Path(os.environ.get("LAKESHARD_MAIN_PYTHON") or REPO / ".venv" / "bin" / "python")
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"the main environment's Python {path} is missing: run scripts/setup.sh "
            "(or set LAKESHARD_MAIN_PYTHON); the petastorm tests need it to run the jobs"
        )
    return path


def run_job(module: str, *args: str) -> None:
    env = {**os.environ, "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")}
    env.pop("PYTHONPATH", None)
    python = main_python()
    env["PYSPARK_PYTHON"] = str(python)
    proc = subprocess.run(
        [str(python), "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{python} -m {module} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )


@pytest.fixture(scope="session")
def petastorm_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four uneven classes of JPEGs -> 3 shards per channel, the ``pad`` remainder policy (so
    shards hold repeated rows marked ``is_pad``), row groups of ~8 KiB (several per shard)."""
    tmp = tmp_path_factory.mktemp("petastorm")
    lake = tmp / "raw"
    write_lake(lake, {"ant": 41, "bee": 33, "cow": 27, "doe": 20}, size=(40, 32), fmt="JPEG")
    out = tmp / "ds"
    run_job(
        "jobs.manifest",
        "--input",
        str(lake),
        "--output",
        str(out),
        "--seed",
        "11",
        "--split-method",
        "stratified",
        "--engine",
        "dask",
    )
    run_job(
        "jobs.shard",
        "--dataset",
        str(out),
        "--num-shards",
        "3",
        "--image-size",
        "24",
        "--image-format",
        "jpeg",
        "--remainder",
        "pad",
        "--row-group-size",
        "8KiB",
        "--engine",
        "dask",
    )
    return out
