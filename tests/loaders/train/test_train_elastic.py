"""``python -m loaders.train --resume`` on another number of ranks: a 2-rank torchrun killed
mid-epoch resumes on 1 rank and on 3, with the same global batch, and the interrupted epoch
trains on every sample exactly once (the records of ``tests/hardening/recording_train.py`` and
``metrics.json`` both say so); a global batch the new world size cannot keep is refused."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from loader_builders import write_dataset

from lakeshard.errors import ConfigError
from loaders.train.config import TrainConfig
from loaders.train.loop import main, train
from loaders.train.world import World

REPO = Path(__file__).resolve().parents[3]

#: 48 train rows in 2 shards; a global batch of 12: 4 steps an epoch on any world size that divides 12.
ROWS = {"train": 48, "validation": 6, "test": 6}
ARGS = [
    "--batch-size",
    "12",
    "--no-progress",
    "--no-augment",
    "--width",
    "4",
    "--num-threads",
    "1",
    "--shuffle-window",
    "8",
    "--checkpoint-every",
    "2",
    "--dist-timeout",
    "60",
    "--epochs",
    "2",
]


def _torchrun(nproc: int, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "tests.hardening.recording_train",
        *args,
    ]
    full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def _records(prefix: Path) -> list[dict]:
    return [
        json.loads(line)
        for p in sorted(prefix.parent.glob(prefix.name + "-rank*.jsonl"))
        for line in p.read_text().splitlines()
    ]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("new_world", [1, 3])
def test_a_killed_two_rank_run_resumes_on_another_world_size_every_sample_once(
    tmp_path: Path, new_world: int
):
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows=ROWS, num_shards=2, size=8)
    base = ["--dataset", str(data), "--output", str(out), *ARGS]

    # 2 ranks x 6 rows; killed (every rank) in epoch 1 after 3 steps, its checkpoint at step 2.
    killed = _torchrun(
        2,
        base,
        tmp_path,
        LAKESHARD_RECORD=str(tmp_path / "first"),
        LAKESHARD_DIE_EPOCH="1",
        LAKESHARD_DIE_AFTER="3",
    )
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert "dies now (os._exit) at epoch 1, step 3" in killed.stderr
    ckpt = torch.load(io.BytesIO((out / "checkpoint.pt").read_bytes()), weights_only=True)
    assert (ckpt["loader"]["epoch"], ckpt["loader"]["batches_consumed"], ckpt["epoch_done"]) == (1, 2, False)
    assert ckpt["loader"]["legs"] == [{"world_size": 2, "batch_size": 6, "batches": 2}]

    per_rank = 12 // new_world
    resumed = _torchrun(new_world, [*base, "--resume"], tmp_path, LAKESHARD_RECORD=str(tmp_path / "second"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"at epoch 1, step 2 (saved on 2 rank(s) x 6 rows, now {new_world} x {per_rank})"
    ) in resumed.stderr

    # Epoch 1's samples: the steps before the checkpoint (the killed run's later step is redone),
    # then everything the resumed run trained on in epoch 1: each of the 48 exactly once.
    before = [r for r in _records(tmp_path / "first") if r["epoch"] == 1 and r["step"] < 2]
    after = [r for r in _records(tmp_path / "second") if r["epoch"] == 1]
    assert len(before) == 2 * 2 and len(after) == new_world * 2  # 2 steps on each rank, before and after
    seen = Counter(i for r in before + after for i in r["ids"])
    assert seen == Counter(range(48))
    steps = Counter(r["step"] for r in after)
    assert steps == {2: new_world, 3: new_world}  # every new rank yields the same steps

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == new_world and metrics["global_batch_size"] == 12
    assert [e["epoch"] for e in metrics["epochs"]] == [0, 1]
    first, second = metrics["epochs"]
    assert (first["samples"], first["images"], first["steps"]) == (48, 48, 4)
    assert (second["samples"], second["images"], second["steps"], second["resumed_at_step"]) == (48, 48, 2, 2)
    assert second["legs"] == [
        {"world_size": 2, "batch_size": 6, "batches": 2},
        {"world_size": new_world, "batch_size": per_rank, "batches": 2},
    ]
    assert 0.0 <= metrics["test_accuracy"] <= 1.0


def _checkpointed(tmp_path: Path) -> TrainConfig:
    """A one-epoch single-process run with a global batch of 8; its config to resume from."""
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    args = [
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--batch-size",
        "8",
        "--no-progress",
        "--width",
        "4",
    ]
    assert main([*args, "--epochs", "1"]) == 0
    (epoch,) = json.loads((out / "metrics.json").read_text())["epochs"]
    assert (epoch["samples"], epoch["legs"]) == (16, [{"world_size": 1, "batch_size": 8, "batches": 2}])
    return TrainConfig(
        dataset=str(data), output=str(out), batch_size=8, epochs=2, width=4, progress=False, resume="auto"
    )


def test_a_resume_keeps_its_global_batch_and_names_the_world_sizes_that_can(tmp_path: Path):
    cfg = _checkpointed(tmp_path)
    cpu = torch.device("cpu")
    with pytest.raises(
        ConfigError,
        match=r"cannot resume .*checkpoint\.pt on 3 ranks: its global batch 8 \(1 rank\(s\) x 8 rows\) "
        r"is not divisible by 3; resume on a world size that divides 8 \(1, 2, 4, 8\)",
    ):
        train(cfg, World(0, 3, 0, 3, cpu))
    with pytest.raises(
        ConfigError,
        match=r"--batch-size 4 \(global\) differs from the global batch 8 \(1 rank\(s\) x 8 rows\) "
        r"of the checkpoint .*checkpoint\.pt: a resumed run keeps its global batch; pass --batch-size 8",
    ):
        train(dataclasses.replace(cfg, batch_size=4), World(0, 1, 0, 1, cpu))
