"""The class archive of the driver JVM the Spark engine starts itself (``python -m jobs.spark_cds``,
design/0048): made once by real JVMs, then mapped by the engine's JVM (the JVM's own class-load
log says where each class came from); an archive not made whole is never handed to a JVM; the
command's other actions and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.common.engines import jvm_archive

REPO = Path(__file__).resolve().parents[3]

#: The engine started as the jobs start it, its JVM logging where each class was loaded from.
_ENGINE = """
import sys
sys.path.insert(0, sys.argv[1])
from jobs.common.engines.spark_engine import SparkEngine
from jobs.common.engines.jvm_archive import probe_task

engine = SparkEngine(master="local[1]")
bean = engine.spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
print("JVM:", *[a for a in bean.getInputArguments() if "Shared" in a or "cds" in a])
assert engine.map_partitions(probe_task, [1, 2], partitions=1) == [2, 4]
engine.close()
"""


def _command(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobs.spark_cds", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_archive_is_made_once_and_the_engines_jvm_loads_sparks_classes_from_it(tmp_path: Path) -> None:
    env = {"LAKESHARD_SPARK_CDS_DIR": str(tmp_path / "cds"), "SPARK_LOCAL_IP": "127.0.0.1"}
    made = _command(env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    (archive,) = (tmp_path / "cds").glob("spark-*.jsa")
    assert f"made {archive} (" in made.stdout
    record = json.loads(archive.with_suffix(".json").read_text())
    assert record["size"] == archive.stat().st_size > 10 * 2**20, record
    assert sorted(p.name for p in (tmp_path / "cds").iterdir()) == [
        archive.name,
        archive.with_suffix(".json").name,
    ]

    again = _command(env=env)
    assert again.returncode == 0 and f"{archive} (" in again.stdout and "is there already" in again.stdout
    checked = _command("--check", env=env)
    assert checked.returncode == 0 and checked.stdout.startswith(f"{archive}: made ("), checked.stdout

    loads = tmp_path / "class-load.log"
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE, str(REPO)],
        env={
            **os.environ,
            **env,
            "PYSPARK_SUBMIT_ARGS": f"--driver-java-options -Xlog:class+load=info:file={loads} pyspark-shell",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rsplit("JVM:", 1)[1].split() == ["-Xlog:cds*=off", f"-XX:SharedArchiveFile={archive}"]
    assert "cds" not in proc.stderr.lower()
    spark_context = [
        line for line in loads.read_text().splitlines() if " org.apache.spark.SparkContext " in line
    ]
    assert spark_context and all("source: shared objects file (top)" in line for line in spark_context), (
        spark_context
    )

    removed = _command("--remove", env=env)
    assert removed.returncode == 0 and f"removed {archive}" in removed.stdout
    assert list((tmp_path / "cds").iterdir()) == []


def _fake_archive(size: int, recorded: int) -> Path:
    path = jvm_archive.archive_path()
    assert path is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    path.with_suffix(".json").write_text(json.dumps({"size": recorded}))
    return path


def test_only_an_archive_of_the_recorded_size_reaches_the_jvm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAKESHARD_SPARK_CDS_DIR", str(tmp_path / "cds"))
    monkeypatch.delenv("LAKESHARD_SPARK_CDS", raising=False)
    assert jvm_archive.driver_options() == ""  # none made
    path = _fake_archive(100, recorded=200)  # cut short: a JVM mapping it could crash
    assert jvm_archive.driver_options() == ""
    path.with_suffix(".json").write_text("{not json")
    assert jvm_archive.driver_options() == ""
    _fake_archive(200, recorded=200)
    assert jvm_archive.driver_options() == f"-Xlog:cds*=off -XX:SharedArchiveFile={path}"
    monkeypatch.setenv("LAKESHARD_SPARK_CDS", "off")
    assert jvm_archive.driver_options() == ""


def test_an_archive_folder_spark_would_split_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAKESHARD_SPARK_CDS_DIR", str(tmp_path / "my cds"))
    monkeypatch.delenv("LAKESHARD_SPARK_CDS", raising=False)
    _fake_archive(10, recorded=10)
    assert jvm_archive.driver_options() == ""
    proc = _command(env={"LAKESHARD_SPARK_CDS_DIR": str(tmp_path / "my cds")})
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        f"jobs/spark_cds.py: error: the archive folder {tmp_path / 'my cds'} has a space or a quote in its "
        "path, which Spark would split; set LAKESHARD_SPARK_CDS_DIR to a folder without one"
    ), proc.stderr


def test_check_and_remove_without_an_archive_and_remove_leaves_an_archive_being_made(tmp_path: Path) -> None:
    # (no spark-defaults.conf of the machine's: one could add a reason to --check's line)
    env = {"LAKESHARD_SPARK_CDS_DIR": str(tmp_path), "SPARK_CONF_DIR": str(tmp_path / "no-conf")}
    checked = _command("--check", env=env)
    assert checked.returncode == 0 and checked.stdout.strip().endswith(
        ": not made; run `python -m jobs.spark_cds` to make it"
    ), checked.stdout
    assert _command("--remove", env=env).stdout.strip() == f"no archive in {tmp_path}"
    being_made = tmp_path / ".spark-4.1.4-0123456789abcdef.x1y2.tmp"
    being_made.write_bytes(b"written by a JVM now")
    (tmp_path / "spark-4.1.4-0123456789abcdef.jsa").write_bytes(b"old")
    (tmp_path / "spark-4.1.4-0123456789abcdef.json").write_text("{}")
    removed = _command("--remove", env=env)
    assert removed.stdout.split() == [
        "removed",
        str(tmp_path / "spark-4.1.4-0123456789abcdef.jsa"),
        "removed",
        str(tmp_path / "spark-4.1.4-0123456789abcdef.json"),
    ]
    assert [p.name for p in tmp_path.iterdir()] == [being_made.name]
    usage = _command("--check", "--remove", env=env)
    assert usage.returncode == 2 and "not allowed with argument" in usage.stderr


def test_check_says_when_the_engine_would_not_use_the_archive(tmp_path: Path) -> None:
    """``--check`` names what keeps the engine's JVM off an archive, made or not: a
    ``spark-defaults.conf`` that sets ``spark.driver.defaultJavaOptions`` (with the options to add
    there), ``LAKESHARD_SPARK_CDS=off``."""
    conf = tmp_path / "conf"
    conf.mkdir()
    env = {"LAKESHARD_SPARK_CDS_DIR": str(tmp_path / "cds"), "SPARK_CONF_DIR": str(conf)}
    checked = _command("--check", env=env)
    assert checked.returncode == 0 and checked.stdout.strip().endswith(
        ": not made; run `python -m jobs.spark_cds` to make it"
    )
    (conf / "spark-defaults.conf").write_text("spark.driver.defaultJavaOptions -Xss4m\n")
    path = Path(checked.stdout.split(":", 1)[0])
    left_alone = (
        f"{conf / 'spark-defaults.conf'} sets spark.driver.defaultJavaOptions, which the engine leaves alone: "
        f"add `-Xlog:cds*=off -XX:SharedArchiveFile={path}` there to use it"
    )
    checked = _command("--check", env=env)
    assert checked.stdout.strip() == (
        f"{path}: not made; run `python -m jobs.spark_cds` to make it (once made, it would not be used: {left_alone})"
    ), checked.stdout
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * 2**20)
    path.with_suffix(".json").write_text(json.dumps({"size": 2**20}))
    checked = _command("--check", env=env)
    assert checked.stdout.strip() == f"{path}: made (1 MiB); not used: {left_alone}", checked.stdout
    (conf / "spark-defaults.conf").write_text("spark.driver.memory 2g\n")
    checked = _command("--check", env=env)
    assert checked.stdout.strip() == f"{path}: made (1 MiB); the Spark engine's driver JVM maps it"
    checked = _command("--check", env={**env, "LAKESHARD_SPARK_CDS": "off"})
    assert checked.stdout.strip() == (
        f"{path}: made (1 MiB); not used: LAKESHARD_SPARK_CDS=off starts the driver JVM without it"
    )
