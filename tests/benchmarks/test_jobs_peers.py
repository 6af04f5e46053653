"""The jobs benchmark (benchmarks/peers/jobs_run.py) runs every tool whose environment is here on a
small lake, and each writes every image once with the per-image work's bytes; a tool whose
environment (or module) is missing is a row saying so; a run's CPU counts the processes that
leave its tree. (No test asserts a speed.)

The peers' environments come from ``scripts/setup_peers.sh`` and ``scripts/setup_petastorm.sh``
(``scripts/test.sh`` runs them)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.procs import RAY_BESIDE_THE_SUITE, assert_usage_errors, run_json_tool

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "peers" / "jobs_run.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import jobs_lakeshard  # noqa: E402 - benchmarks/ is not a package
import jobs_run  # noqa: E402
import metered  # noqa: E402

#: A multiple of the 2 workers and of the 4 classes.
IMAGES = 48


def _run(tmp: Path, *args: str) -> tuple[str, dict[str, Any]]:
    out = tmp / "jobs_peers.json"
    command = [sys.executable, str(RUN), "--work", str(tmp / "work"), "--out", str(out), *args]
    return run_json_tool(command, out, cwd=ROOT, timeout=1800, extra_env=RAY_BESIDE_THE_SUITE)


@pytest.fixture(scope="module")
def every_tool(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("jobs-peers")
    args = ("--images", str(IMAGES), "--classes", "4", "--rounds", "1", "--workers", "2")
    return _run(tmp, *args)[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", sorted(jobs_run.TOOLS))
def test_each_tool_writes_every_image_once_with_the_same_bytes(every_tool: dict[str, Any], name: str) -> None:
    tool = jobs_run.TOOLS[name]
    row = every_tool["table"][name]
    if why := tool.missing(ROOT):  # its environment or its module (a tool being added) is not here
        assert row == {"error": why}
        return
    assert "error" not in row, row
    (run,) = every_tool["runs"][name]
    assert run["images"] == IMAGES and run["cpu_s"] > 0 and run["peak_pss"] > 0, run
    assert run["steady_images_per_s"] is not None and run["images_per_s"] > 0, run
    if name in jobs_run.WRITES_NOTHING:
        assert row["check"] == {"skipped": "writes nothing"}
        return
    assert run["bytes_written"] > 0
    assert row["check"] == {"stored": IMAGES, "missing": 0, "extra": 0, "same": True}


@pytest.mark.slow
def test_a_missing_environment_is_a_row_saying_so(tmp_path: Path) -> None:
    stdout, result = _run(
        tmp_path,
        *("--tools", "ceiling,webdataset", "--envs", str(tmp_path / "none")),
        *("--images", "8", "--rounds", "1", "--workers", "2"),
    )
    assert result["table"]["webdataset"] == {"error": "not installed: bash scripts/setup_peers.sh webdataset"}
    assert result["table"]["ceiling"]["runs"] == 1
    assert "webdataset       not installed: bash scripts/setup_peers.sh webdataset" in stdout


def test_bad_arguments_are_one_line_before_any_work(tmp_path: Path) -> None:
    cases = [
        (["--tools", "ceiling,tfdata"], "['tfdata']: choose from ceiling, lakeshard-local"),
        (["--images", "0"], "argument --images: must be a whole number of at least 1, got '0'"),
    ]
    assert_usage_errors(RUN, tmp_path / "w", cases, cwd=ROOT)


def test_the_shard_jobs_preprocessing_span_is_read_from_its_log() -> None:
    lines = [
        "2026-01-02 03:04:05,100 INFO jobs.shard: plan: train=8×1",
        "a line of Spark's own, 26/01/02 03:04:05 WARN",
        "2026-01-02 03:04:05,250 INFO jobs.shard: preprocessing 8 images (train) straight into 1 shard files",
        "2026-01-02 03:04:07,750 INFO jobs.shard: assembling 1 of 1 shard files",
    ]
    first, last = jobs_lakeshard.preprocessing_span(lines) or (0.0, 0.0)
    assert last - first == pytest.approx(2.5)
    assert jobs_lakeshard.preprocessing_span(lines[:3]) is None


def test_a_runs_cpu_counts_the_processes_that_leave_its_tree(tmp_path: Path) -> None:
    if not metered.cgroup_available():
        pytest.skip(f"no cgroup can be made under {metered.CGROUP_ROOT} here (not root, or no cgroup v1)")
    # The command starts a process in a session of its own that works for 0.6 s of CPU after the
    # command has exited, and another that would sleep for a minute: the first is counted, the
    # second is killed at the end and counted as left over.
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)\\n" + burn], start_new_session=True)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        print("started")
        time.sleep(0.5)
        """
    )
    with open(tmp_path / "err", "w") as err:
        m = metered.run_metered([sys.executable, "-c", script], env={}, cwd=tmp_path, stderr=err, timeout=60)
    assert (m.returncode, m.stdout.strip(), m.cpu_from, m.leftover) == (0, "started", "cgroup", 1)
    assert m.cpu_s >= 0.6
    assert m.peak_pss > 0


def test_a_runs_cpu_between_two_moments_is_what_it_spent_then(tmp_path: Path) -> None:
    """The steady state's CPU (``cpu_s_between``): a command that sleeps 1 s, then works for
    0.6 s of CPU, telling when each began and ended; within a sampling interval at each end."""
    if not metered.cgroup_available():
        pytest.skip(f"no cgroup can be made under {metered.CGROUP_ROOT} here (not root, or no cgroup v1)")
    script = textwrap.dedent(
        """
        import time
        a = time.time(); time.sleep(1.0); b = time.time()
        t = time.process_time()
        while time.process_time() - t < 0.6: pass
        print(a, b, time.time())
        """
    )
    with open(tmp_path / "err", "w") as err:
        m = metered.run_metered([sys.executable, "-c", script], env={}, cwd=tmp_path, stderr=err, timeout=60)
    slept, worked, end = map(float, m.stdout.split())
    idle, busy = m.cpu_s_between(slept, worked), m.cpu_s_between(worked, end)
    assert idle is not None and busy is not None, m.cpu_samples
    assert idle < 0.2 and 0.45 < busy < 0.8, (idle, busy)
    assert m.cpu_s_between(slept - 3600, end) is None  # before the command started: no samples around it


def test_our_packages_are_compiled_before_the_runs_as_an_install_would(tmp_path: Path) -> None:
    import importlib.util

    sources = [tmp_path / "jobs" / "__init__.py", tmp_path / "lakeshard" / "format" / "info.py"]
    for source in sources:
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("VALUE = 1\n")
    jobs_run.compile_ours(tmp_path)
    for source in sources:
        assert Path(importlib.util.cache_from_source(str(source))).is_file(), source
    (tmp_path / "lakeshard" / "broken.py").write_text("def (:\n")
    with pytest.raises(SystemExit, match=f"could not compile {tmp_path / 'lakeshard'}"):
        jobs_run.compile_ours(tmp_path)
