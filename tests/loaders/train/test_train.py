"""``python -m loaders.train``: config, bad input as one error line, single-process training and
resume (``--resume auto`` included), datasets without validation or test, a 2-rank torchrun."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from loader_builders import write_dataset

from lakeshard.errors import ConfigError
from lakeshard.format import channel_dirname
from loaders.train.config import TrainConfig, build_parser, load_config, parse_args
from loaders.train.loop import main, train
from loaders.train.world import World

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "conf" / "train.yaml"


def test_train_yaml_sets_and_comments_every_option():
    keys = load_config(CONF)
    assert set(keys) == {f.name for f in dataclasses.fields(TrainConfig)}
    lines = CONF.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+:", line):
            assert lines[i - 1].startswith("#"), f"key on line {i + 1} has no comment: {line!r}"
    # the file's values are the dataclass defaults (one source of truth for --help)
    assert TrainConfig(**keys) == TrainConfig()


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text
    assert "--no-augment" in text and "--conf" in text
    assert "75 stopped by SIGTERM or SIGUSR1 after saving a checkpoint" in " ".join(text.split())


def test_python_m_loaders_train_runs_main(monkeypatch, capsys):
    """``python -m loaders.train`` is :func:`main` on the command line (run here in this process;
    tests/test_layering.py runs it in a fresh one)."""
    monkeypatch.setattr(sys, "argv", ["python -m loaders.train", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("loaders.train", run_name="__main__")
    assert done.value.code == 0 and "usage: python -m loaders.train" in capsys.readouterr().out


def test_command_line_overrides_the_file(tmp_path: Path):
    conf = tmp_path / "c.yaml"
    conf.write_text("dataset: /data/a\nepochs: 9\nlr: 0.5\naugment: true\n")
    cfg = parse_args(["--conf", str(conf), "--epochs", "2", "--no-augment", "--resume"])
    assert (cfg.dataset, cfg.epochs, cfg.lr, cfg.augment, cfg.resume) == ("/data/a", 2, 0.5, False, "auto")
    conf.write_text("epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'epoch' in .*c.yaml"):
        parse_args(["--conf", str(conf)])
    conf.write_text("dataset: x\noptimizer: adam\n")
    with pytest.raises(
        ConfigError, match=r"--optimizer \(.*c.yaml\): expected one of adamw, sgd, got 'adam'"
    ):
        parse_args(["--conf", str(conf)])
    with pytest.raises(SystemExit):  # argparse names the choices
        parse_args(["--dataset", "x", "--optimizer", "adam"])
    with pytest.raises(ConfigError, match="dataset is required"):
        parse_args([])


def test_global_batch_must_split_across_ranks(tmp_path: Path):
    write_dataset(tmp_path)
    cfg = TrainConfig(dataset=str(tmp_path), batch_size=8, output=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="batch_size 8 \\(global\\) is not divisible by the world size 3"):
        train(cfg, World(0, 3, 0, 3, torch.device("cpu")))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(path.read_bytes()), weights_only=True)["model"]


def test_single_process_training_and_resume_match_an_uninterrupted_run(tmp_path: Path, capsys):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 48, "validation": 12, "test": 12}, size=16)
    base = [
        "--dataset",
        str(data),
        "--batch-size",
        "8",
        "--no-progress",
        "--num-threads",
        "2",
        "--width",
        "8",
    ]
    assert main([*base, "--epochs", "2", "--output", str(tmp_path / "a")]) == 0
    summary = capsys.readouterr().out
    assert re.search(r"test accuracy \d\.\d{4} \| \d+ images/s \| data wait \d+% \(per rank\)", summary)
    assert main([*base, "--epochs", "1", "--output", str(tmp_path / "b")]) == 0
    assert main([*base, "--epochs", "2", "--output", str(tmp_path / "b"), "--resume"]) == 0

    a = json.loads((tmp_path / "a/metrics.json").read_text())
    b = json.loads((tmp_path / "b/metrics.json").read_text())
    assert [e["epoch"] for e in a["epochs"]] == [e["epoch"] for e in b["epochs"]] == [0, 1]
    for key in ("loss", "val_accuracy"):
        assert [e[key] for e in b["epochs"]] == pytest.approx([e[key] for e in a["epochs"]], rel=1e-5)
    assert 0.0 <= a["test_accuracy"] <= 1.0 and len(a["epochs"][0]["data_wait_share"]) == 1
    wa, wb = _weights(tmp_path / "a/checkpoint.pt"), _weights(tmp_path / "b/checkpoint.pt")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


def _error_line(capsys) -> str:
    """The one line ``main`` printed on stderr for a bad input (no traceback, nothing else)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m loaders.train: error: "), err
    return lines[0]


def test_resume_refuses_a_checkpoint_of_another_dataset_version(tmp_path: Path, capsys):
    data = tmp_path / "ds"
    write_dataset(data, version="aaaa")
    base = [
        "--dataset",
        str(data),
        "--batch-size",
        "4",
        "--no-progress",
        "--width",
        "4",
        "--output",
        str(tmp_path / "o"),
    ]
    assert main([*base, "--epochs", "1"]) == 0
    write_dataset(data, version="bbbb")
    capsys.readouterr()
    assert main([*base, "--epochs", "2", "--resume"]) == 2
    assert re.search(r"dataset version 'aaaa'.*is version 'bbbb'", _error_line(capsys))


def _one_class(root: Path) -> list[str]:
    write_dataset(root, num_classes=1)
    return []


def _yaml_resume_true(root: Path) -> list[str]:
    write_dataset(root)
    (root / "c.yaml").write_text("resume: true\n")
    return ["--conf", str(root / "c.yaml")]


def _dataset(root: Path) -> list[str]:
    write_dataset(root)
    return []


@pytest.mark.parametrize(
    ("make", "extra", "env", "message"),
    [
        (_one_class, [], {}, r"dataset\.json lists 1 class\(es\) \(class0\): a classifier needs at least 2"),
        (
            _yaml_resume_true,
            [],
            {},
            r"--resume \(.*c\.yaml\): expected a checkpoint path or 'auto', got True",
        ),
        (
            _dataset,
            ["--seed", str(2**32)],
            {},
            r"--seed \(command line\): expected an integer from 0 to 4294967295 .*got '4294967296'",
        ),
        (
            _dataset,
            ["--resume", "gone/checkpoint.pt"],
            {},
            r"--resume gone/checkpoint\.pt: no checkpoint at file://.*/gone/checkpoint\.pt",
        ),
        # As torchrun starts rank 1 of 3: refused before the process group (which would wait for
        # ranks that never come).
        (
            _dataset,
            [],
            {"WORLD_SIZE": "3", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"},
            r"batch_size 8 \(global\) is not divisible by the world size 3: .* \(rank 1\)$",
        ),
    ],
    ids=["one-class", "yaml-resume-true", "seed-too-big", "resume-path-missing", "batch-vs-ranks"],
)
def test_bad_input_is_one_error_line_and_status_2_before_any_work(
    tmp_path, capsys, monkeypatch, make, extra, env, message
):
    data = tmp_path / "ds"
    extra = [*make(data), *extra]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = [
        "--dataset",
        str(data),
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--no-progress",
        "--width",
        "4",
        "--output",
        str(out),
        *extra,
    ]
    assert main(argv) == 2
    assert re.search(message, _error_line(capsys))
    assert not out.exists() and not (tmp_path / "True").exists()  # nothing trained, nothing written


def test_resume_auto_starts_afresh_then_resumes(tmp_path: Path, caplog):
    data, out = tmp_path / "ds", tmp_path / "out"
    write_dataset(data, rows={"train": 16, "validation": 6, "test": 6})
    base = [
        "--dataset",
        str(data),
        "--batch-size",
        "4",
        "--no-progress",
        "--width",
        "4",
        "--output",
        str(out),
        "--resume",
        "auto",
    ]
    with caplog.at_level(logging.INFO, logger="loaders.train"):
        assert main([*base, "--epochs", "1"]) == 0
    assert f"--resume auto: no checkpoint at file://{out}/checkpoint.pt, starting a fresh run" in caplog.text
    assert "resumed from" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loaders.train"):
        assert main([*base, "--epochs", "2"]) == 0  # the same command line, after a "preemption"
    assert f"resumed from file://{out}/checkpoint.pt at epoch 1, step 0" in caplog.text
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [0, 1]


def _drop_channels(root: Path, channels: tuple[str, ...]) -> None:
    """Make ``root`` a dataset built with a split that has no ``channels`` (as the shard job
    writes it: dataset.json lists only the split's channels)."""
    info = json.loads((root / "dataset.json").read_text())
    for channel in channels:
        del info["channels"][channel]
        shutil.rmtree(root / "shards" / channel_dirname(channel))
    (root / "dataset.json").write_text(json.dumps(info))


@pytest.mark.parametrize(
    "missing", [("test",), ("validation", "test")], ids=["train-validation", "train-only"]
)
def test_a_dataset_without_validation_or_test_trains_and_says_what_it_skipped(
    tmp_path, capsys, caplog, missing
):
    data, out = tmp_path / "ds", tmp_path / "out"
    write_dataset(data, rows={"train": 16, "validation": 6, "test": 6})
    _drop_channels(data, missing)
    (data / "labels.json").unlink()  # the trainer reads the labels from dataset.json only
    argv = [
        "--dataset",
        str(data),
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--no-progress",
        "--width",
        "4",
        "--output",
        str(out),
    ]
    with caplog.at_level(logging.INFO, logger="loaders.train"):
        assert main(argv) == 0
    present = "train" + ("" if "validation" in missing else ", validation")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test_accuracy"] is None
    assert metrics["skipped"]["test"] == f"the dataset has no 'test' channel (it has: {present})"
    assert "skipping the final test: the dataset has no 'test' channel" in caplog.text
    assert "test accuracy n/a (no test channel)" in capsys.readouterr().out
    val = metrics["epochs"][0]["val_accuracy"]
    if "validation" in missing:
        assert val is None and metrics["skipped"]["validation"].startswith(
            "the dataset has no 'validation' channel"
        )
        assert "skipping validation after each epoch" in caplog.text
    else:
        assert 0.0 <= val <= 1.0 and set(metrics["skipped"]) == {"test"}


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "loaders.train",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_two_rank_torchrun_trains_checkpoints_and_resumes(tmp_path: Path):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 40, "validation": 10, "test": 10}, num_shards=2, size=16)
    out = tmp_path / "run"
    base = [
        "--dataset",
        str(data),
        "--batch-size",
        "8",
        "--no-progress",
        "--width",
        "8",
        "--output",
        str(out),
        "--conf",
        str(CONF),
        "--dist-timeout",
        "60",
    ]
    first = _torchrun([*base, "--epochs", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "test accuracy" in first.stdout
    assert "joined the gloo process group" in first.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert len(metrics["epochs"]) == 1 and len(metrics["epochs"][0]["data_wait_share"]) == 2
    assert metrics["epochs"][0]["steps"] == 5  # 20 rows per rank, 4 per rank-batch
    ckpt = torch.load(io.BytesIO((out / "checkpoint.pt").read_bytes()), weights_only=True)
    assert ckpt["dataset_version"] == "0123abcd" and ckpt["loader"]["batches_consumed"] == 5

    second = _torchrun([*base, "--epochs", "2", "--resume"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at epoch 1, step 0" in second.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [0, 1]
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    assert yaml.safe_load(CONF.read_text())["epochs"] == 5  # the file was only read


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_rank_torchrun_refuses_a_global_batch_it_cannot_split_without_a_traceback(tmp_path: Path):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 8, "validation": 4, "test": 4})
    run = _torchrun(
        ["--dataset", str(data), "--batch-size", "5", "--output", str(tmp_path / "run")], tmp_path
    )
    assert run.returncode != 0
    # Each rank that got as far as printing (torchrun stops the other rank once one has exited)
    # printed the same one line; torchrun reports the exit status 2. Its own launcher traceback
    # follows, but no rank's: no frame of the trainer.
    mine = [line for line in run.stderr.splitlines() if "error:" in line]
    assert mine and {re.sub(r" \(rank \d\)$", "", line) for line in mine} == {
        "python -m loaders.train: error: batch_size 5 (global) is not divisible by the world size 2: "
        "each rank would get 2.5 rows; pass a --batch-size that is a multiple of 2"
    }, run.stderr[-3000:]
    assert re.search(r"exitcode\s*: 2 ", run.stderr), run.stderr[-3000:]
    assert "loaders/train/loop.py" not in run.stderr and "ConfigError" not in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / "run").exists()
