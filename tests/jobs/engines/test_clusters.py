"""The jobs on real clusters on 127.0.0.1, launched the way a user launches them, against the
dataset Spark writes in local mode.

- Dask: ``dask scheduler`` + two ``dask worker`` processes; ``python -m jobs.manifest
  --engine dask --scheduler tcp://...``.
- Spark: a standalone master + worker from pip's pyspark; ``spark-submit --master spark://...
  --py-files lakeshard-pyfiles.zip jobs/manifest.py``. The executors run the venv's
  interpreter without its site hooks (``python -S`` plus site-packages on PYTHONPATH), so the
  editable install is invisible to them: they import ``jobs`` from the zip or fail.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from lakeshard import storage
from lakeshard.format import read_dataset_info
from tests.jobs.engines.compare import assert_same_dataset
from tests.jobs.engines.conftest import BIN, MANIFEST_OPTS, REPO, SHARD_OPTS, cli_args, job_env, run_job

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.dask
@pytest.mark.spark
def test_dask_cluster_by_address(
    dask_cli_cluster: str, spark_reference: str, mixed_lake: str, tmp_path: Path
) -> None:
    out = str(tmp_path / "ds")
    common = ["--engine", "dask", "--scheduler", dask_cli_cluster]
    stdout = run_job(
        [
            sys.executable,
            "-m",
            "jobs.manifest",
            "--input",
            mixed_lake,
            "--output",
            out,
            *cli_args(MANIFEST_OPTS),
            *common,
        ]
    )
    on_disk = sum(1 for p in Path(mixed_lake).rglob("*") if p.is_file())
    assert f"manifest: {on_disk} listed," in stdout
    run_job([sys.executable, "-m", "jobs.shard", "--dataset", out, *cli_args(SHARD_OPTS), *common])
    assert_same_dataset(spark_reference, out)
    assert read_dataset_info(storage.normalize(out)).engine == "dask"


def _executor_python(folder: Path) -> Path:
    """The venv's interpreter minus site processing: pyarrow and friends, but not lakeshard."""
    wrapper = folder / "python-without-lakeshard"
    site = sysconfig.get_paths()["purelib"]
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} -S "$@"\n'
    )
    wrapper.chmod(0o755)
    probe = subprocess.run(
        [str(wrapper), "-c", "import pyarrow, PIL, fsspec; import jobs"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert "No module named 'jobs'" in probe.stderr, probe.stderr
    return wrapper


@pytest.mark.spark
@pytest.mark.timeout(1800)  # two spark-submits to a standalone cluster: 258-470 s on a busy machine
def test_spark_standalone_with_py_files(
    spark_cluster: str, spark_reference: str, mixed_lake: str, tmp_path: Path
) -> None:
    pyfiles = tmp_path / "lakeshard-pyfiles.zip"
    subprocess.run(
        [str(REPO / "scripts" / "build_pyfiles.sh"), str(pyfiles)], check=True, capture_output=True
    )
    env = job_env(PYSPARK_PYTHON=str(_executor_python(tmp_path)), PYSPARK_DRIVER_PYTHON=sys.executable)
    submit = [
        str(BIN / "spark-submit"),
        "--master",
        spark_cluster,
        "--driver-memory",
        "1g",
        "--executor-memory",
        "1g",
        "--conf",
        "spark.ui.enabled=false",
        "--py-files",
        str(pyfiles),
    ]
    out = str(tmp_path / "ds")
    run_job(
        [*submit, "jobs/manifest.py", "--input", mixed_lake, "--output", out, *cli_args(MANIFEST_OPTS)],
        env=env,
    )
    run_job([*submit, "jobs/shard.py", "--dataset", out, *cli_args(SHARD_OPTS)], env=env)
    assert_same_dataset(spark_reference, out)
