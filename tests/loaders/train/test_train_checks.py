"""``python -m loaders.train`` checks before any training: an ``--output`` it cannot write (a
file, a missing S3 bucket), a ``--resume`` with another model or optimizer, a ``--model`` whose
output does not fit the data; and a progress bar only on a terminal."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from loader_builders import write_dataset

from loaders.train import main

REPO = Path(__file__).resolve().parents[3]
FACTORIES = "tests.loaders.train.model_factories"


def _argv(data: Path, out: str | Path, *extra: str) -> list[str]:
    return [
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--no-progress",
        "--num-threads",
        "1",
        "--width",
        "4",
        *extra,
    ]


def _error_line(capsys) -> str:
    """The one line ``main`` printed on stderr for a bad input (no traceback, nothing else)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m loaders.train: error: "), err
    return lines[0]


# -- --output ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_an_output_that_is_a_file_is_refused_before_training(tmp_path: Path, capsys, caplog, where: str):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    taken = tmp_path / "taken"
    taken.write_text("not a folder\n")
    out = taken if where == "a-file" else taken / "run"
    with caplog.at_level(logging.INFO, logger="loaders.train"):
        assert main(_argv(data, out)) == 2
    line = _error_line(capsys)
    assert re.search(
        rf"--output {re.escape(str(out))}: cannot write there: {re.escape(str(taken))} is a file, not a folder",
        line,
    ), line
    assert "epoch 0" not in caplog.text  # refused before the first epoch
    assert taken.read_text() == "not a folder\n"


def test_a_writable_output_keeps_no_probe(tmp_path: Path):
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    assert main(_argv(data, out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "metrics.json"]


def test_a_tensorboard_dir_that_cannot_be_written_is_one_error_line(tmp_path: Path):
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    (tmp_path / "afile").write_text("x")
    tb = tmp_path / "afile" / "tb"
    cmd = [sys.executable, "-m", "loaders.train", *_argv(data, out, "--tensorboard-dir", str(tb))]
    run = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        f"python -m loaders.train: error: --tensorboard-dir {tb}: cannot write there: "
        f"{tmp_path / 'afile'} is a file, not a folder"
    ]
    assert not out.exists() or not list(out.iterdir())  # no checkpoint, no metrics


@pytest.mark.s3
def test_an_output_in_a_missing_bucket_is_refused_before_training(
    tmp_path: Path, capsys, caplog, s3_endpoint: str
):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    with caplog.at_level(logging.INFO, logger="loaders.train"):
        assert main(_argv(data, "s3://nobucket-lakeshard/run")) == 2
    line = _error_line(capsys)
    assert re.search(
        r"--output s3://nobucket-lakeshard/run: cannot write there: the bucket 'nobucket-lakeshard' "
        r"does not exist",
        line,
    ), line
    assert "epoch 0" not in caplog.text


@pytest.mark.s3
@pytest.mark.slow
def test_an_s3_output_is_checked_and_written_without_a_probe_left(tmp_path: Path, s3_bucket: str):
    import boto3

    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    assert main(_argv(data, f"{s3_bucket}/run")) == 0
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket[len("s3://") :]).get("Contents", [])]
    assert sorted(keys) == ["run/checkpoint.pt", "run/metrics.json"]


# -- --resume with another model or optimizer -----------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-epoch run (the small CNN of width 4, AdamW) to resume: ``(dataset, output)``."""
    root = tmp_path_factory.mktemp("resume-options")
    data, out = root / "ds", root / "run"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    assert main(_argv(data, out)) == 0
    return data, out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--width", "8"],
            r"--width 8 differs from the checkpoint .*checkpoint\.pt, trained with --width 4: "
            r"a resumed run keeps its model, optimizer and learning-rate schedule; pass --width 4",
        ),
        (
            ["--optimizer", "sgd"],
            r"--optimizer sgd differs from the checkpoint .*checkpoint\.pt, trained with "
            r"--optimizer adamw: .*; pass --optimizer adamw",
        ),
        (
            ["--model", f"{FACTORIES}:linear"],
            rf"--model {FACTORIES}:linear differs from the checkpoint .*checkpoint\.pt, trained with no --model "
            r"\(the small CNN\): .*; pass no --model",
        ),
        (
            ["--lr", "0.5"],
            r"--lr 0\.5 differs from the checkpoint .*checkpoint\.pt, trained with --lr 0\.01: .*; pass --lr 0\.01",
        ),
        (
            ["--weight-decay", "0.5"],
            r"--weight-decay 0\.5 differs from the checkpoint .*, trained with --weight-decay 0\.01:",
        ),
    ],
    ids=["width", "optimizer", "model", "lr", "weight-decay"],
)
def test_resume_with_another_model_optimizer_or_schedule_names_the_option(
    trained, capsys, extra: list[str], message: str
):
    data, out = trained
    before = (out / "checkpoint.pt").read_bytes()
    assert main([*_argv(data, out, *extra), "--epochs", "2", "--resume", "auto"]) == 2
    line = _error_line(capsys)
    assert re.search(message, line), line
    assert (out / "checkpoint.pt").read_bytes() == before


def test_resume_with_a_factory_that_changed_names_the_checkpoint(tmp_path: Path, capsys):
    """The same ``--model`` whose factory now builds another network (edited since)."""
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    assert main(_argv(data, out, "--model", f"{FACTORIES}:linear")) == 0
    import torch

    path = out / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["model"]["fc.weight"] = torch.zeros(3, 5)  # as if the factory's layer had another size
    torch.save(ckpt, path)
    capsys.readouterr()
    assert (
        main([*_argv(data, out, "--model", f"{FACTORIES}:linear"), "--epochs", "2", "--resume", "auto"]) == 2
    )
    line = _error_line(capsys)
    assert re.search(
        rf"--resume: the checkpoint .*checkpoint\.pt does not fit --model '{FACTORIES}:linear': "
        r".*size mismatch for fc\.weight",
        line,
    ), line


# -- --model output ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (
            "for_32px_images",
            r"a forward pass on a float32 \[2, 3, 8, 8\] batch \(the dataset's image size\) failed: "
            r"RuntimeError: mat1 and mat2 shapes cannot be multiplied",
        ),
        (
            "one_score_per_image",
            r"returned a tensor of shape \[2\] for a float32 \[2, 3, 8, 8\] batch; expected "
            r"logits of shape \[2, 3\] \(batch, classes: the dataset has 3\)",
        ),
        (
            "logits_and_probabilities",
            r"returned a tuple for a float32 \[2, 3, 8, 8\] batch; expected a tensor of "
            r"logits of shape \[2, 3\]",
        ),
        ("no_parameters", r"the model has no trainable parameters"),
        (
            "three_classes_too_many",
            r"returned a tensor of shape \[2, 6\] for a float32 \[2, 3, 8, 8\] batch; "
            r"expected logits of shape \[2, 3\]",
        ),
    ],
    ids=["wrong-input-size", "one-score", "tuple", "no-parameters", "classes-plus-3"],
)
def test_a_model_that_does_not_fit_the_data_is_one_error_line(
    tmp_path: Path, capsys, caplog, factory: str, message: str
):
    data, out = tmp_path / "ds", tmp_path / "run"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})
    with caplog.at_level(logging.INFO, logger="loaders.train"):
        assert main(_argv(data, out, "--model", f"{FACTORIES}:{factory}")) == 2
    line = _error_line(capsys)
    assert line.startswith(f"python -m loaders.train: error: --model '{FACTORIES}:{factory}': "), line
    assert re.search(message, line), line
    assert "epoch 0" not in caplog.text and not out.exists()


# -- progress --------------------------------------------------------------------------------------
def _train_command(data: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loaders.train",
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--num-threads",
        "1",
        "--width",
        "4",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_progress_is_a_bar_on_a_terminal_and_a_line_per_epoch_in_a_log(tmp_path: Path):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 16, "validation": 4, "test": 4})

    log = tmp_path / "train.log"
    with open(log, "wb") as f:
        run = subprocess.run(
            _train_command(data, tmp_path / "a"),
            cwd=tmp_path,
            env=_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=240,
        )
    text = log.read_text()
    assert run.returncode == 0, text[-3000:]
    assert "\r" not in text and "it/s]" not in text, text[-3000:]
    assert [int(e) for e in re.findall(r"epoch (\d): loss", text)] == [0, 1]

    # On a terminal (stderr a pseudo-terminal): the bar, redrawn with \r.
    controller, terminal = pty.openpty()
    fcntl.ioctl(
        terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0)
    )  # 24 x 120, as a terminal has
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the terminal's last holder closed it
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, name="pty-reader")
    reader.start()
    try:
        run = subprocess.run(
            _train_command(data, tmp_path / "b"),
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=terminal,
            timeout=240,
        )
    finally:
        os.close(terminal)
        reader.join(timeout=30)
        os.close(controller)
    shown = b"".join(chunks).decode(errors="replace")
    assert run.returncode == 0, shown[-3000:]
    assert re.search(r"\repoch 0: +100%\|", shown), shown[-3000:]
