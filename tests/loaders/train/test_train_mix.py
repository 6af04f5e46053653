"""``python -m loaders.train --dataset A:0.7 --dataset B:0.3``: each epoch holds the weights'
exact shares, labels are joined by name, validation runs over both datasets, ``metrics.json``
counts each source's rows; a 2-rank ``torchrun`` killed mid-epoch and resumed on 3 ranks trains on
every planned sample of the interrupted epoch exactly once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from loader_builders import ids_of, write_dataset

from lakeshard.errors import ConfigError
from loaders import MixedLoader
from loaders.train.config import parse_args
from loaders.train.loop import main
from tests.loaders.train.test_train_checks import _env
from tests.loaders.train.test_train_elastic import _records, _torchrun

B_FIRST = 1000
ARGS = ["--batch-size", "12", "--no-progress", "--no-augment", "--width", "4", "--num-threads", "1"]
ARGS += ["--shuffle-window", "8", "--dist-timeout", "60"]


def _two(tmp_path: Path) -> tuple[Path, Path]:
    """A: 40 train rows, labels class0..2; B: 12 rows (ids from 1000) whose labels are class2,
    zebra, class0 (so B's label 0 is the union's 2)."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_dataset(a, rows={"train": 40, "validation": 6, "test": 6})
    write_dataset(
        b,
        rows={"train": 12, "validation": 6, "test": 6},
        first_id=B_FIRST,
        version="b0b0b0b0",
        label_names=["class2", "zebra", "class0"],
    )
    return a, b


def test_training_on_two_datasets_holds_their_shares_every_epoch(tmp_path: Path):
    a, b = _two(tmp_path)
    out = tmp_path / "run"
    args = ["--dataset", f"{a}:0.7", "--dataset", f"{b}:0.3", "--samples-per-epoch", "60", "--epochs", "2"]
    assert main([*args, "--output", str(out), *ARGS]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["dataset"] == [f"{a}:0.7", f"{b}:0.3"]
    assert metrics["dataset_version"] == "0123abcd+b0b0b0b0"
    for epoch in metrics["epochs"]:
        assert (epoch["samples"], epoch["steps"]) == (60, 5)
        assert [(s["planned_rows"], s["rows"]) for s in epoch["sources"]] == [(42, 42), (18, 18)]
        assert [s["weight"] for s in epoch["sources"]] == pytest.approx([0.7, 0.3])
    # validation over both datasets' channels, in the union's 4 classes
    val = metrics["epochs"][-1]["validation"]
    counts = {name: (c["index"], c["count"]) for name, c in val["per_class"].items()}
    assert counts == {"class0": (0, 4), "class1": (1, 2), "class2": (2, 4), "zebra": (3, 2)}
    assert 0.0 <= metrics["test_accuracy"] <= 1.0


def test_bad_dataset_lists_are_one_line_before_any_work(tmp_path: Path):
    a, b = _two(tmp_path)
    with pytest.raises(ConfigError, match="give every dataset a weight"):
        parse_args(["--dataset", f"{a}:0.7", "--dataset", str(b)])
    with pytest.raises(ConfigError, match=r"--dataset \(command line\): .*positive weight, got '.*:0'"):
        parse_args(["--dataset", f"{a}:0", "--dataset", f"{b}:1"])
    big = tmp_path / "big"
    write_dataset(big, rows={"train": 8, "validation": 0, "test": 0}, size=12, first_id=5000)
    out = tmp_path / "run"
    assert main(["--dataset", str(a), "--dataset", str(big), "--output", str(out), *ARGS]) == 2


def _train(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m loaders.train ARGS`` in a process of its own."""
    cmd = [sys.executable, "-m", "loaders.train", *args, *ARGS]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _one_error_line(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m loaders.train: error: "), run.stderr[-3000:]
    return lines[0]


def test_the_same_dataset_twice_is_one_error_line(tmp_path: Path):
    a, _ = _two(tmp_path)
    args = ["--dataset", f"{a}:0.7", "--dataset", f"file://{a}/:0.3", "--output", str(tmp_path / "run")]
    line = _one_error_line(_train(args, tmp_path))
    assert f"'{a}:0.7' and 'file://{a}/:0.3' are the same dataset, file://{a}: give each dataset once" in line
    assert not (tmp_path / "run").exists()


def test_samples_per_epoch_with_one_dataset_is_one_error_line(tmp_path: Path):
    a, _ = _two(tmp_path)
    args = ["--dataset", str(a), "--samples-per-epoch", "24", "--output", str(tmp_path / "run")]
    line = _one_error_line(_train(args, tmp_path))
    assert "--samples-per-epoch (command line): 24 applies to a mixture" in line and "drop it" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a trainer process (torch's import) or two
def test_a_weight_that_gets_no_row_is_one_error_line(tmp_path: Path):
    a, b = _two(tmp_path)
    args = ["--dataset", f"{a}:0.004", "--dataset", f"{b}:0.996", "--samples-per-epoch", "120"]
    line = _one_error_line(_train([*args, "--output", str(tmp_path / "run")], tmp_path))
    assert f"source {a} (weight 0.004, 0.004 of the mixture) gets 0 of the 120 samples of every epoch" in line
    assert "give it a weight of at least 0.00837" in line
    assert not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.slow  # a trainer process (torch's import) or two
def test_one_dataset_that_exists_as_given_is_that_path_colons_and_all(tmp_path: Path):
    a, _ = _two(tmp_path)
    shutil.copytree(a, tmp_path / "b:0.5")  # a's copy (version 0123abcd), beside b
    shutil.copytree(a, tmp_path / "run-12:30")
    assert parse_args(["--dataset", str(tmp_path / "run-12:30")]).dataset == str(tmp_path / "run-12:30")
    out = tmp_path / "run"
    run = _train(["--dataset", "b:0.5", "--epochs", "1", "--output", str(out)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["dataset"], metrics["dataset_version"]) == ("b:0.5", "0123abcd")
    assert metrics["epochs"][0]["samples"] == 36  # a's 40 train rows in whole batches of 12, not b's 12


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_killed_two_rank_mixture_resumes_on_three_ranks_every_planned_sample_once(tmp_path: Path):
    a, b = _two(tmp_path)
    out = tmp_path / "run"
    base = [
        "--dataset",
        f"{a}:0.7",
        "--dataset",
        f"{b}:0.3",
        "--samples-per-epoch",
        "60",
        "--output",
        str(out),
    ]
    base += [*ARGS, "--checkpoint-every", "2", "--epochs", "2"]
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
    resumed = _torchrun(3, [*base, "--resume", "auto"], tmp_path, LAKESHARD_RECORD=str(tmp_path / "second"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 1, step 2 (saved on 2 rank(s) x 6 rows, now 3 x 4)" in resumed.stderr

    # What epoch 1 plans, read by one uninterrupted loader of the same mixture.
    with MixedLoader(
        [(str(a), 0.7), (str(b), 0.3)], channel="train", batch_size=12, samples_per_epoch=60, seed=7, shuffle=True,
        shuffle_window=8, num_threads=1,
    ) as ld:  # fmt: skip
        ld.set_epoch(1)
        planned = Counter(i for images, _ in ld for i in ids_of(images))
    assert sum(i >= B_FIRST for i in planned.elements()) == 18

    first = _records(tmp_path / "first")
    assert Counter(i >= B_FIRST for r in first if r["epoch"] == 0 for i in r["ids"]) == {False: 42, True: 18}
    before = [r for r in first if r["epoch"] == 1 and r["step"] < 2]
    after = [r for r in _records(tmp_path / "second") if r["epoch"] == 1]
    assert Counter(r["step"] for r in after) == {2: 3, 3: 3, 4: 3}  # every new rank the same steps
    assert Counter(i for r in before + after for i in r["ids"]) == planned

    metrics = json.loads((out / "metrics.json").read_text())
    second = metrics["epochs"][1]
    assert (second["samples"], second["resumed_at_step"]) == (60, 2)
    assert second["legs"] == [
        {"world_size": 2, "batch_size": 6, "batches": 2},
        {"world_size": 3, "batch_size": 4, "batches": 3},
    ]


def test_a_resume_with_another_mixture_is_refused_naming_what_changed(tmp_path: Path, capsys):
    a, b = _two(tmp_path)
    out = tmp_path / "run"
    base = ["--output", str(out), *ARGS, "--samples-per-epoch", "60"]
    assert main(["--dataset", f"{a}:0.7", "--dataset", f"{b}:0.3", *base, "--epochs", "1"]) == 0
    capsys.readouterr()
    again = [*base, "--epochs", "2", "--resume", "auto"]
    assert main(["--dataset", f"{a}:0.6", "--dataset", f"{b}:0.4", *again]) == 2
    assert (
        f"source file://{a} had weight 0.7 when the mixture state was saved, now 0.6"
        in capsys.readouterr().err
    )
    write_dataset(b, rows={"train": 12, "validation": 6, "test": 6}, first_id=B_FIRST, version="b1b1b1b1")
    assert main(["--dataset", f"{a}:0.7", "--dataset", f"{b}:0.3", *again]) == 2
    err = capsys.readouterr().err
    assert f"it was trained on {b} version 'b0b0b0b0', which is now version 'b1b1b1b1'" in err


@pytest.mark.slow  # a trainer process (torch's import) or two
def test_a_resume_with_the_datasets_in_another_order_is_one_error_line_naming_the_order(tmp_path: Path):
    """F6: the same mixture given in another order is named as such (with the order to pass), not
    as two rebuilt datasets."""
    a, b = _two(tmp_path)
    out = tmp_path / "run"
    base = ["--output", str(out), "--samples-per-epoch", "24"]
    first = _train(["--dataset", f"{a}:0.7", "--dataset", f"{b}:0.3", *base, "--epochs", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = ["--dataset", f"{b}:0.3", "--dataset", f"{a}:0.7", *base, "--epochs", "2", "--resume", "auto"]
    line = _one_error_line(_train(again, tmp_path))
    assert f"the checkpoint mixes file://{a}, file://{b} in that order" in line
    assert f"pass them in the checkpoint's order: --dataset {a}:0.7 --dataset {b}:0.3" in line
    assert "version" not in line
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["epochs"]) == 1  # nothing trained, nothing written
