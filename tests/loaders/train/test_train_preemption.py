"""``python -m loaders.train`` stopped by SIGTERM or SIGUSR1 (a spot reclaim, Kubernetes, Slurm):
every rank finishes its step, rank 0 saves a checkpoint, the run exits with status 75, and
``--resume auto`` continues it so that every sample of every epoch is trained exactly once.
Real processes and real signals: to a single-process run during its evaluations, to torchrun
(which forwards it to its ranks), and to one of torchrun's ranks only. The training code is the
real one; ``tests/hardening/recording_train.py`` records what each rank trained on and slows
every batch down so that the signal lands mid-epoch."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from loader_builders import until, write_dataset

from loaders.train import main
from tests.helpers.procs import free_port

REPO = Path(__file__).resolve().parents[3]
RECORDING = ["-m", "tests.hardening.recording_train"]

pytestmark = pytest.mark.slow


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train_records(prefix: Path, rank: int) -> list[dict]:
    return _lines(prefix.parent / f"{prefix.name}-rank{rank}.jsonl")


def _checkpoint(out: Path) -> dict:
    return torch.load(io.BytesIO((out / "checkpoint.pt").read_bytes()), weights_only=True)


@contextmanager
def _started(cmd: list[str], log: Path, **env: str) -> Iterator[subprocess.Popen]:
    """``cmd`` running in its own session, its output in ``log``. Stopped (SIGTERM, which
    torchrun forwards to its ranks, then SIGKILL) if the test leaves it running."""
    full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)


def _signal_when(
    proc: subprocess.Popen, ready: Callable[[], bool], what: str, send: Callable[[], None], log: Path
) -> int:
    """Wait until ``ready()``, ``send()`` a signal and return the exit status of ``proc``."""
    until(lambda: proc.poll() is not None or ready(), what, timeout=180)
    assert proc.poll() is None, (
        f"the run ended (status {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
    )
    send()
    return proc.wait(timeout=120)


# -- one process, signalled during its evaluations and between two epochs --------------------------
def test_a_signal_during_evaluation_or_between_epochs_saves_a_checkpoint_that_resumes_exactly(
    tmp_path: Path, caplog
):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 16, "validation": 12, "test": 12})
    args = [
        "--dataset",
        str(data),
        "--batch-size",
        "4",
        "--eval-batch-size",
        "1",
        "--epochs",
        "2",
        "--width",
        "4",
        "--num-threads",
        "1",
        "--no-progress",
    ]
    assert main([*args, "--output", str(tmp_path / "ref")]) == 0  # the uninterrupted run
    ref = json.loads((tmp_path / "ref/metrics.json").read_text())

    out = tmp_path / "run"
    cmd = [sys.executable, *RECORDING, *args, "--output", str(out), "--resume", "auto"]
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"

    # SIGTERM while epoch 0's validation runs: its training steps are done, its validation is not.
    log = tmp_path / "first.log"
    with _started(cmd, log, LAKESHARD_RECORD=str(first), LAKESHARD_BATCH_SECONDS="0.1") as proc:
        rc = _signal_when(
            proc,
            lambda: bool(_lines(tmp_path / "first-validation-rank0.jsonl")),
            "epoch 0 is validated",
            lambda: os.kill(proc.pid, signal.SIGTERM),
            log,
        )
    text = log.read_text()
    assert rc == 75, text[-3000:]
    assert (
        f"SIGTERM: saved the checkpoint file://{out}/checkpoint.pt at epoch 0, step 4 of 4 (before its validation)"
        "; exiting with status 75: rerun with --resume auto to continue" in text
    ), text[-3000:]
    assert "Traceback" not in text
    ckpt = _checkpoint(out)
    assert (ckpt["loader"]["epoch"], ckpt["loader"]["batches_consumed"], ckpt["epoch_done"]) == (0, 4, False)
    assert (ckpt["epoch_partial"]["samples"], ckpt["metrics"]) == (16, [])
    assert [r["step"] for r in _train_records(first, 0)] == [0, 1, 2, 3]
    assert len(_lines(tmp_path / "first-validation-rank0.jsonl")) < 12  # stopped mid-validation

    # Resumed: epoch 0's validation again; SIGTERM once it is done (between epochs 0 and 1).
    log = tmp_path / "second.log"
    with _started(cmd, log, LAKESHARD_RECORD=str(second), LAKESHARD_SIGNAL_AFTER="validation") as proc:
        rc = proc.wait(timeout=120)
    text = log.read_text()
    assert rc == 75, text[-3000:]
    assert "resumed from" in text and "at epoch 0, step 4" in text
    assert "sends itself SIGTERM after its validation batches" in text
    assert (
        f"SIGTERM: saved the checkpoint file://{out}/checkpoint.pt after epoch 0; exiting with status 75"
        in text
    )
    ckpt = _checkpoint(out)
    assert (ckpt["loader"]["epoch"], ckpt["epoch_done"], [e["epoch"] for e in ckpt["metrics"]]) == (
        0,
        True,
        [0],
    )
    assert _train_records(second, 0) == [] and len(_lines(tmp_path / "second-validation-rank0.jsonl")) == 12

    # Resumed: epoch 1; SIGUSR1 during the final test.
    log = tmp_path / "third.log"
    with _started(cmd, log, LAKESHARD_RECORD=str(third), LAKESHARD_BATCH_SECONDS="0.1") as proc:
        rc = _signal_when(
            proc,
            lambda: bool(_lines(tmp_path / "third-test-rank0.jsonl")),
            "the test runs",
            lambda: os.kill(proc.pid, signal.SIGUSR1),
            log,
        )
    text = log.read_text()
    assert rc == 75, text[-3000:]
    assert (
        f"SIGUSR1: saved the checkpoint file://{out}/checkpoint.pt after epoch 1 (before the final test)"
        in text
    )
    assert "resumed from" in text and "at epoch 1, step 0" in text
    ckpt = _checkpoint(out)
    assert (ckpt["loader"]["epoch"], ckpt["epoch_done"], len(ckpt["metrics"])) == (1, True, 2)
    trained = _train_records(third, 0)
    assert [(r["epoch"], r["step"]) for r in trained] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert Counter(i for r in trained for i in r["ids"]) == Counter(range(16))
    assert len(_lines(tmp_path / "third-validation-rank0.jsonl")) == 12  # epoch 1's, in full
    assert len(_lines(tmp_path / "third-test-rank0.jsonl")) < 12  # stopped mid-test

    # Resumed again: the test only; the same numbers as the uninterrupted run.
    with caplog.at_level("INFO", logger="loaders.train"):
        assert main([*args, "--output", str(out), "--resume", "auto"]) == 0
    assert "at epoch 2, step 0" in caplog.text
    got = json.loads((out / "metrics.json").read_text())
    assert [e["epoch"] for e in got["epochs"]] == [0, 1]
    for key in ("loss", "val_accuracy", "samples", "images"):
        assert [e[key] for e in got["epochs"]] == pytest.approx([e[key] for e in ref["epochs"]], rel=1e-5), (
            key
        )
    assert got["test_accuracy"] == pytest.approx(ref["test_accuracy"])
    want = _checkpoint(tmp_path / "ref")["model"]
    for name, value in _checkpoint(out)["model"].items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6)


# -- torchrun, 2 ranks: SIGTERM to torchrun, then SIGUSR1 to one rank only ---------------------------
#: 48 train rows in 2 shards, a global batch of 4: 12 steps an epoch, 2 rows per rank and step.
ROWS = {"train": 48, "validation": 8, "test": 8}


#: torchrun's default signals plus SIGUSR1, as the README and docs/training.md tell Slurm users.
SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sigusr1_to_torchrun_told_to_handle_it_stops_every_rank_with_a_checkpoint(tmp_path: Path):
    """The README's line: SIGUSR1 to torchrun (given --signals-to-handle ...,SIGUSR1) stops both
    ranks at one step with a checkpoint, and no rank goes on training after torchrun has gone."""
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert f"SIGUSR1 to torchrun itself needs `torchrun {SIGNALS}`" in readme  # the flag tested here
    data, out, prefix, log = tmp_path / "ds", tmp_path / "run", tmp_path / "rec", tmp_path / "run.log"
    write_dataset(data, rows=ROWS, num_shards=2, size=8)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SIGNALS]
    cmd += [*RECORDING, "--dataset", str(data), "--output", str(out), "--batch-size", "4", "--epochs", "2"]
    cmd += ["--no-progress", "--width", "4", "--num-threads", "1", "--dist-timeout", "60"]
    with _started(cmd, log, LAKESHARD_RECORD=str(prefix), LAKESHARD_BATCH_SECONDS="0.2") as proc:
        rc = _signal_when(
            proc,
            lambda: len(_train_records(prefix, 0)) >= 3,
            "rank 0 trains step 2",
            lambda: os.kill(proc.pid, signal.SIGUSR1),  # torchrun alone, not its process group
            log,
        )
    text = log.read_text()
    assert rc != 0, text[-3000:]
    stop = _checkpoint(out)["loader"]["batches_consumed"]
    assert f"SIGUSR1: saved the checkpoint file://{out}/checkpoint.pt at epoch 0, step {stop} of 12" in text
    for rank in (0, 1):  # both stopped at that step, and neither is still running
        assert [r["step"] for r in _train_records(prefix, rank)] == list(range(stop)), text[-3000:]
        pid = _train_records(prefix, rank)[0]["pid"]
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_signalled_two_rank_torchrun_stops_at_one_step_and_resumes_every_sample_once(tmp_path: Path):
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows=ROWS, num_shards=2, size=8)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *RECORDING,
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--no-progress",
        "--width",
        "4",
        "--num-threads",
        "1",
        "--shuffle-window",
        "8",
        "--dist-timeout",
        "60",
        "--resume",
        "auto",
    ]
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"

    # SIGTERM to torchrun's process group, in epoch 0. The ranks run in sessions of their own:
    # torchrun forwards the signal to each (and would SIGKILL them after --shutdown-timeout).
    log = tmp_path / "first.log"
    with _started(cmd, log, LAKESHARD_RECORD=str(first), LAKESHARD_BATCH_SECONDS="0.2") as proc:
        rc = _signal_when(
            proc,
            lambda: len(_train_records(first, 0)) >= 3,
            "rank 0 trains step 2",
            lambda: os.killpg(proc.pid, signal.SIGTERM),
            log,
        )
    text = log.read_text()
    assert rc != 0, text[-3000:]
    ckpt = _checkpoint(out)
    stop1 = ckpt["loader"]["batches_consumed"]
    assert (ckpt["loader"]["epoch"], ckpt["epoch_done"]) == (0, False) and 3 <= stop1 < 12, text[-3000:]
    assert (
        f"SIGTERM: saved the checkpoint file://{out}/checkpoint.pt at epoch 0, step {stop1} of 12; exiting with "
        "status 75: rerun with --resume auto to continue" in text
    ), text[-3000:]
    for rank in (0, 1):  # each rank trained exactly the steps the checkpoint holds
        assert [(r["epoch"], r["step"]) for r in _train_records(first, rank)] == [
            (0, s) for s in range(stop1)
        ]
    partial = ckpt["epoch_partial"]  # the totals of the steps before the stop, all ranks
    assert (partial["epoch"], partial["samples"], partial["images"]) == (0, 4 * stop1, 4 * stop1)
    assert partial["loss_sum"] > 0

    # Resumed; SIGUSR1 (Slurm's warning) to rank 1 only, in epoch 1: rank 0 stops at the same step.
    log = tmp_path / "second.log"
    with _started(cmd, log, LAKESHARD_RECORD=str(second), LAKESHARD_BATCH_SECONDS="0.2") as proc:
        rc = _signal_when(
            proc,
            lambda: sum(r["epoch"] == 1 for r in _train_records(second, 1)) >= 3,
            "rank 1 trains step 2 of epoch 1",
            lambda: os.kill(_train_records(second, 1)[0]["pid"], signal.SIGUSR1),
            log,
        )
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert f"at epoch 0, step {stop1}" in text
    assert "exitcode  : 75" in text, text[-3000:]  # torchrun's report of the ranks' status
    ckpt = _checkpoint(out)
    stop2 = ckpt["loader"]["batches_consumed"]
    assert (ckpt["loader"]["epoch"], ckpt["epoch_done"]) == (1, False) and 3 <= stop2 < 12, text[-3000:]
    assert f"SIGUSR1: saved the checkpoint file://{out}/checkpoint.pt at epoch 1, step {stop2} of 12" in text
    for rank in (0, 1):
        steps = [(r["epoch"], r["step"]) for r in _train_records(second, rank)]
        assert steps == [(0, s) for s in range(stop1, 12)] + [(1, s) for s in range(stop2)], rank

    # Resumed to the end.
    log = tmp_path / "third.log"
    with _started(cmd, log, LAKESHARD_RECORD=str(third)) as proc:
        rc = proc.wait(timeout=300)
    assert rc == 0, log.read_text()[-3000:]

    runs = {
        name: [r for rank in (0, 1) for r in _train_records(prefix, rank)]
        for name, prefix in (("first", first), ("second", second), ("third", third))
    }
    for epoch in (0, 1):
        seen = Counter(
            i for records in runs.values() for r in records if r["epoch"] == epoch for i in r["ids"]
        )
        assert seen == Counter(range(48)), epoch  # every sample of the epoch, once over the three runs
    metrics = json.loads((out / "metrics.json").read_text())
    assert [(e["epoch"], e["samples"], e["resumed_at_step"]) for e in metrics["epochs"]] == [
        (0, 48, stop1),
        (1, 48, stop2),
    ]
    assert 0.0 <= metrics["test_accuracy"] <= 1.0


@pytest.mark.distributed
def test_a_checkpoint_that_cannot_be_saved_stops_every_rank_with_an_error(tmp_path: Path):
    """Two ranks started as a launcher without torchrun's supervision starts them (srun, mpirun:
    one process each, no agent to kill the others). Rank 0's periodic save fails (its --output
    replaced by a file once training runs); rank 1 learns it in the same collective and stops
    with its own error line at once, instead of waiting in its next all-reduce for
    --dist-timeout."""
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows=ROWS, num_shards=2, size=8)
    cmd = [sys.executable, *RECORDING, "--dataset", str(data), "--output", str(out), "--batch-size", "4"]
    cmd += ["--epochs", "2", "--no-progress", "--width", "4", "--num-threads", "1", "--shuffle-window", "8"]
    cmd += ["--checkpoint-every", "3", "--dist-timeout", "120"]
    records, port = tmp_path / "rec", free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.update(
        LAKESHARD_RECORD=str(records), LAKESHARD_BATCH_SECONDS="0.3", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"
    )
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = []
    try:
        for r in (0, 1):
            with open(logs[r], "w") as f:
                rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
                procs.append(
                    subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=rank_env, cwd=REPO)
                )
        until(lambda: len(_train_records(records, 0)) >= 1, "rank 0 trains step 0")
        shutil.rmtree(out)
        out.write_text("not a folder")
        broken = time.monotonic()
        codes = [p.wait(timeout=100) for p in procs]
        took = time.monotonic() - broken
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [log.read_text() for log in logs]
    assert codes == [2, 2] and took < 60, (codes, took, texts[0][-2000:], texts[1][-2000:])
    assert re.search(
        r"loaders\.train: error: cannot write file://.*/run/checkpoint\.pt.* \(rank 0\)", texts[0]
    )
    assert "error: rank 0 could not save the checkpoint file://" in texts[1] and "(rank 1)" in texts[1], (
        texts[1]
    )
