"""``python -m loaders.train``: config, single-process training and resume, a 2-rank torchrun."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from loader_builders import write_dataset

from lakeshard.errors import ConfigError, DatasetError
from loaders.config import TrainConfig, build_parser, load_config, parse_args
from loaders.train import _Dist, main, train

REPO = Path(__file__).resolve().parents[2]
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


def test_command_line_overrides_the_file(tmp_path: Path):
    conf = tmp_path / "c.yaml"
    conf.write_text("dataset: /data/a\nepochs: 9\nlr: 0.5\naugment: true\n")
    cfg = parse_args(["--conf", str(conf), "--epochs", "2", "--no-augment", "--resume"])
    assert (cfg.dataset, cfg.epochs, cfg.lr, cfg.augment, cfg.resume) == ("/data/a", 2, 0.5, False, "auto")
    conf.write_text("epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'epoch' in .*c.yaml"):
        parse_args(["--conf", str(conf)])
    conf.write_text("dataset: x\noptimizer: adam\n")
    with pytest.raises(ConfigError, match=r"--optimizer \(.*c.yaml\): expected one of adamw, sgd, got 'adam'"):
        parse_args(["--conf", str(conf)])
    with pytest.raises(SystemExit):  # argparse names the choices
        parse_args(["--dataset", "x", "--optimizer", "adam"])
    with pytest.raises(ConfigError, match="dataset is required"):
        parse_args([])


def test_global_batch_must_split_across_ranks(tmp_path: Path):
    write_dataset(tmp_path)
    cfg = TrainConfig(dataset=str(tmp_path), batch_size=8, output=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="batch_size 8 \\(global\\) is not divisible by the world size 3"):
        train(cfg, _Dist(0, 3, 0, 3, torch.device("cpu")))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(path.read_bytes()), weights_only=True)["model"]


def test_single_process_training_and_resume_match_an_uninterrupted_run(tmp_path: Path, capsys):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 48, "validation": 12, "test": 12}, size=16)
    base = ["--dataset", str(data), "--batch-size", "8", "--no-progress", "--num-threads", "2", "--width", "8"]
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


def test_resume_refuses_a_checkpoint_of_another_dataset_version(tmp_path: Path):
    data = tmp_path / "ds"
    write_dataset(data, version="aaaa")
    base = ["--dataset", str(data), "--batch-size", "4", "--no-progress", "--width", "4", "--output", str(tmp_path / "o")]
    assert main([*base, "--epochs", "1"]) == 0
    write_dataset(data, version="bbbb")
    with pytest.raises(DatasetError, match=r"dataset version 'aaaa'.*is version 'bbbb'"):
        main([*base, "--epochs", "2", "--resume"])


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "loaders.train", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_two_rank_torchrun_trains_checkpoints_and_resumes(tmp_path: Path):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 40, "validation": 10, "test": 10}, num_shards=2, size=16)
    out = tmp_path / "run"
    base = ["--dataset", str(data), "--batch-size", "8", "--no-progress", "--width", "8", "--output", str(out),
            "--conf", str(CONF), "--dist-timeout", "60"]  # fmt: skip
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
