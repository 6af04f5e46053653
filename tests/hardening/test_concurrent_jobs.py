"""Two jobs on one local dataset never break each other: the second is refused at once with one
line naming the first (its job, process and start), the committed dataset stays readable and
whole whichever job wins, and a killed job leaves no lock behind. Real job processes
(``python -m jobs.shard`` / ``jobs.manifest``). A shard job is held mid-run by one lake image
turned into a named pipe (it waits for the image's bytes, which the test writes when it is done),
a manifest job by SIGSTOP once it holds the lock: the race the test needs happens every time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines import open_engine
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.locks import LOCK_NAME
from tests.hardening.helpers import dataset_digest, job_env, kill_group
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.slow]

_LOCAL = ["--engine", "local"]


def _shard(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.shard",
        *_LOCAL,
        "--dataset",
        str(out),
        "--num-shards",
        "2",
        "--image-size",
        "16",
        "--overwrite",
        *extra,
    ]


def _manifest(lake: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.manifest",
        *_LOCAL,
        "--input",
        str(lake),
        "--output",
        str(out),
        "--split",
        "train=0.8,validation=0.2",
        "--overwrite",
    ]


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Path]:
    """A lake and a committed dataset built from it (in this process)."""
    lake, out = tmp_path / "raw", tmp_path / "ds"
    write_lake(lake, {"a": 40, "b": 40})
    engine = open_engine("local")
    try:
        manifest_job.run(
            ManifestConfig(input=str(lake), output=str(out), split="train=0.8,validation=0.2"), engine
        )
        shard_job.run(ShardConfig(dataset=str(out), num_shards=2, image_size=16), engine)
    finally:
        engine.close()
    return lake, out


def _holder(out: Path) -> dict | None:
    try:
        raw = (out / LOCK_NAME).read_text()
    except FileNotFoundError:
        return None
    return json.loads(raw) if raw.strip() else None


def _start(cmd: list[str], out: Path, log: Path) -> subprocess.Popen:
    """Start ``cmd`` and wait until it holds ``out``'s lock."""
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            cmd, env=job_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while not ((h := _holder(out)) is not None and h["pid"] == proc.pid):
            assert proc.poll() is None, f"the first job ended before it held the lock:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the first job never held the lock:\n{log.read_text()}"
            time.sleep(0.005)
    except BaseException:
        kill_group(proc)
        raise
    return proc


@contextmanager
def _blocked_on_an_image(cmd: list[str], lake: Path, out: Path, log: Path) -> Iterator[subprocess.Popen]:
    """Run the shard job ``cmd`` with one lake image turned into a named pipe: it holds the lock
    and waits for that image's bytes until the block ends (or is killed, if the test fails).
    The image is a regular file again afterwards, with the same bytes."""
    image = sorted(lake.rglob("*.png"))[0]
    data = image.read_bytes()
    image.unlink()
    os.mkfifo(image)
    proc = _start(cmd, out, log)
    try:
        yield proc
        if proc.poll() is None:
            with open(image, "wb") as pipe:  # the job reads the image's bytes, and goes on
                pipe.write(data)
    except BaseException:
        kill_group(proc)
        raise
    finally:
        image.unlink()
        image.write_bytes(data)


@contextmanager
def _stopped(cmd: list[str], out: Path, log: Path) -> Iterator[subprocess.Popen]:
    """Start ``cmd``; once it holds ``out``'s lock, stop it (SIGSTOP) and yield it; on leaving,
    let it go on (SIGCONT). Killed if the test fails."""
    proc = _start(cmd, out, log)
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
        yield proc
        os.killpg(proc.pid, signal.SIGCONT)
    except BaseException:
        kill_group(proc)
        raise


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=120)


def test_a_second_shard_job_and_a_plan_only_run_are_refused_while_a_build_writes(built, tmp_path: Path):
    lake, out = built
    before = dataset_digest(str(out))
    with _blocked_on_an_image(_shard(out), lake, out, tmp_path / "first.log") as first:
        second = _run(_shard(out))
        plan = _run(_shard(out, "--plan-only"))
        # the committed dataset is untouched while the first job is mid-run
        assert dataset_digest(str(out)) == before
    assert first.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()
    for refused, what in ((second, "shard job"), (plan, "--plan-only")):
        assert refused.returncode == 2, (what, refused.stderr)
        lines = refused.stderr.strip().splitlines()
        assert lines[-1].startswith("jobs/shard.py: error: ") and "Traceback" not in refused.stderr, (
            refused.stderr
        )
        assert f"{out}" in lines[-1] and "is busy: shard job is writing it since " in lines[-1]
        assert f"pid {first.pid} on " in lines[-1]
    check_dataset(str(out))
    assert _holder(out) is None  # emptied by the job that held it


def test_a_build_is_refused_while_a_manifest_job_writes_and_two_manifest_jobs_exclude_each_other(tmp_path):
    lake, out = tmp_path / "raw", tmp_path / "ds"
    write_lake(lake, {"a": 1000, "b": 1000}, size=(16, 16))  # a manifest job holds the lock ~1 s
    with _stopped(_manifest(lake, out), out, tmp_path / "first.log") as first:
        second = _run(_manifest(lake, out))
        build = _run(_shard(out))
    assert first.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()
    assert second.returncode == 2 and build.returncode == 2, (second.stderr, build.stderr)
    assert "is busy: manifest job is writing it since " in second.stderr.strip().splitlines()[-1]
    assert "is busy: manifest job is writing it since " in build.stderr.strip().splitlines()[-1]
    assert f"pid {first.pid} on " in build.stderr


def test_a_killed_build_leaves_no_lock_and_the_committed_dataset_readable(built, tmp_path: Path):
    lake, out = built
    before = dataset_digest(str(out))
    with _blocked_on_an_image(_shard(out), lake, out, tmp_path / "first.log") as first:
        kill_group(first)  # SIGKILL: no handler runs; the kernel drops the lock
        assert dataset_digest(str(out)) == before
    rerun = _run(_shard(out))
    assert rerun.returncode == 0, rerun.stderr
    check_dataset(str(out))
    assert dataset_digest(str(out)) == before  # same inputs, same dataset


def test_two_builds_started_together_never_break_the_dataset(built, tmp_path: Path):
    """The race as a user meets it (no job held still): in every round each job either commits
    or is refused with the one busy line, and the dataset is whole after the round."""
    _, out = built
    reference = dataset_digest(str(out))
    for round_ in range(3):
        logs = [tmp_path / f"round{round_}-{i}.log" for i in range(2)]
        procs = []
        for log in logs:
            with open(log, "wb") as sink:
                procs.append(
                    subprocess.Popen(
                        _shard(out),
                        env=job_env(),
                        stdout=subprocess.DEVNULL,
                        stderr=sink,
                        start_new_session=True,
                    )
                )
        results = [(p.wait(timeout=180), log.read_text()) for p, log in zip(procs, logs)]
        assert any(rc == 0 for rc, _ in results), results
        for rc, err in results:
            assert rc == 0 or (
                rc == 2
                and "is busy: shard job is writing it since" in err.splitlines()[-1]
                and "Traceback" not in err
            ), err
        check_dataset(str(out))
        assert dataset_digest(str(out)) == reference
