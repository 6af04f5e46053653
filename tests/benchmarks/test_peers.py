"""The peer benchmark (benchmarks/peers/run.py) runs every tool, from local disk and through the
remote-like store, and each tool delivers every image exactly once per epoch; a tool whose
environment is missing is a row saying so. (No test asserts a speed.)

The peers' environments come from ``scripts/setup_peers.sh`` and petastorm's from
``scripts/setup_petastorm.sh`` (``scripts/test.sh`` runs both); one that is missing fails the full
run test with that command, never skips it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.procs import RAY_BESIDE_THE_SUITE, assert_usage_errors, run_json_tool

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "peers" / "run.py"
PEERS = ("streaming", "litdata", "webdataset", "dataloader", "ray")
#: Read from local disk only (run.py's LOCAL_ONLY), in its own environment.
PETASTORM = ROOT / ".venv-petastorm" / "bin" / "python"
#: A multiple of batch 64 and of the 2 workers: no tool's partitioning has a reason to pad.
IMAGES = 128
#: The whole run (every tool's writer, then 15 runs, Ray's two ~40 s of them) takes ~4.5 min on a
#: quiet 2-core machine and went past 10 min beside the rest of the suite (CI, 2026-11-30); past
#: 28 min once (CI, 2026-12-01) with Ray's workers at nice 15, which ``RAY_BESIDE_THE_SUITE`` ends.
#: The module fixture runs inside its first test, so the timeout of each test here is the run's.
WHOLE_RUN_S = 1700
pytestmark = pytest.mark.timeout(WHOLE_RUN_S + 100)


def _run(tmp: Path, *args: str) -> tuple[str, dict[str, Any]]:
    out = tmp / "peers.json"
    return run_json_tool(
        [sys.executable, str(RUN), "--work", str(tmp / "work"), "--out", str(out), *args],
        out,
        cwd=ROOT,
        timeout=WHOLE_RUN_S,
        extra_env=RAY_BESIDE_THE_SUITE,
    )


@pytest.fixture(scope="module")
def every_tool(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    missing = [p for p in PEERS if not (ROOT / ".venv-peers" / p / "bin" / "python").exists()]
    if missing:
        pytest.fail(f"peer environments missing: run bash scripts/setup_peers.sh {' '.join(missing)}")
    if not PETASTORM.exists():
        pytest.fail("petastorm's environment is missing: run bash scripts/setup_petastorm.sh")
    tmp = tmp_path_factory.mktemp("peers")
    _, result = _run(tmp, "--images", str(IMAGES), "--epochs", "2", "--repeats", "1", "--workers", "2")
    return result


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "name"),
    [("local", t) for t in ("lakeshard", *PEERS, "petastorm")]
    + [("remote", t) for t in ("lakeshard", "lakeshard + cache_dir", *PEERS)],
)
def test_each_tool_delivers_every_image_once_per_epoch(
    every_tool: dict[str, Any], setting: str, name: str
) -> None:
    row = every_tool["tables"][setting][name]
    assert "error" not in row, row
    assert row["runs"] == 1 and not row["failed_runs"]
    assert row["exactly_once"], row
    (variant,) = [v for v in every_tool["runs"] if v["variant"]["setting"] == setting and v["name"] == name]
    (run,) = variant["runs"]
    for epoch in run["epochs"]:
        assert (epoch["images"], epoch["missing"], epoch["repeated"]) == (IMAGES, 0, 0), epoch
        assert epoch["cpu_s"] > 0 and epoch["peak_pss"] > 0
    if setting == "remote":
        first, second = (e["traffic"] for e in run["epochs"])
        # Every remote row read its data through the store, not from the local folder.
        assert first["gets"] > 0 and first["body_bytes"] > 0, first
        cached = name in ("lakeshard + cache_dir", "streaming", "litdata")
        # A cache keeps the second epoch off the store; without one it reads the data again. The
        # loader reads ahead across the epoch boundary (a slow consumer: all of a small epoch 2
        # while epoch 1 is consumed), so the reads again are counted over both epochs: at least
        # every image's bytes twice.
        images_bytes = IMAGES * every_tool["jpegs"]["mean_kb"] * 1000
        if cached:
            assert second["body_bytes"] == 0, (name, second)
            assert first["body_bytes"] < 2 * images_bytes, (name, first)
        else:
            assert first["body_bytes"] + second["body_bytes"] >= 2 * images_bytes, (name, first, second)


@pytest.mark.slow
def test_a_local_only_tool_is_a_remote_row_saying_so(every_tool: dict[str, Any]) -> None:
    row = every_tool["tables"]["remote"]["petastorm"]
    assert row == {
        "error": "local only: petastorm reads s3:// through s3fs, which .venv-petastorm leaves out"
    }


@pytest.mark.slow
def test_a_missing_environment_is_a_row_saying_so(tmp_path: Path) -> None:
    stdout, result = _run(
        tmp_path,
        *("--tools", "lakeshard,webdataset", "--settings", "local", "--venvs", str(tmp_path / "none")),
        *("--images", "64", "--epochs", "1", "--repeats", "1"),
    )
    rows = result["tables"]["local"]
    assert rows["webdataset"] == {"error": "not installed: bash scripts/setup_peers.sh webdataset"}
    assert rows["lakeshard"]["exactly_once"]
    assert "webdataset             not installed: bash scripts/setup_peers.sh webdataset" in stdout


def test_bad_arguments_are_one_line_before_any_work(tmp_path: Path) -> None:
    cases = [
        (["--tools", "lakeshard,tfdata"], "['tfdata']: choose from lakeshard, streaming"),
        (["--images", "0"], "--images must be at least 1, got 0"),
        (["--bandwidth", "fast"], "--bandwidth:"),
    ]
    assert_usage_errors(RUN, tmp_path / "w", cases, cwd=ROOT)


def test_only_a_json_object_on_a_tools_stdout_is_an_epoch_record() -> None:
    """A tool's library may print on stdout (a CI run once got a line from the Ray tool that was
    not its record): run.py logs such a line and reads on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peers_run", RUN)  # benchmarks/peers is not a package
    assert spec is not None and spec.loader is not None
    run = sys.modules["peers_run"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(run)
    assert run.epoch_record('{"epoch": 1, "images": 128}\n') == {"epoch": 1, "images": 128}
    for noise in ("\n", "(raylet) a warning\n", "[1, 2]\n", "128\n"):
        assert run.epoch_record(noise) is None, noise


@pytest.mark.slow
def test_ray_beside_the_suite_runs_its_workers_at_its_priority_with_two_footer_readers(
    tmp_path: Path,
) -> None:
    """The settings both peer tests give Ray (``RAY_BESIDE_THE_SUITE``) reach its workers and its
    Parquet reads: a task's niceness is 0 and one ``read_parquet`` pass starts 2 footer readers
    (Ray's defaults, without them: 15 and 32). A knob Ray renames fails here, not as a timeout."""
    ray_python = ROOT / ".venv-peers" / "ray" / "bin" / "python"
    if not ray_python.exists():
        pytest.fail("Ray's environment is missing: run bash scripts/setup_peers.sh ray")
    script = textwrap.dedent(
        f"""
        import json, os
        import pyarrow as pa, pyarrow.parquet as pq, ray
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        pq.write_table(pa.table({{"x": [1, 2, 3]}}), {str(tmp_path / "a.parquet")!r})
        rows = sum(len(b["x"]) for b in ray.data.read_parquet({str(tmp_path)!r}).iter_batches())
        nice = ray.get(ray.remote(lambda: os.nice(0)).remote())
        actors = ray._private.state.actors().values()
        footers = sum(a["ActorClassName"] == "FooterReader" for a in actors)
        print(json.dumps({{"rows": rows, "nice": nice, "footer_readers": footers}}))
        """
    )
    proc = subprocess.run(
        [str(ray_python), "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **RAY_BESIDE_THE_SUITE},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"rows": 3, "nice": 0, "footer_readers": 2}
