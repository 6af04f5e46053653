"""``python -m loaders.train``: your own model (``--model package.module:factory``), per-class
accuracy in ``metrics.json`` and ``--precision bf16``."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
from loader_builders import write_dataset

from loaders import PAD_LABEL, ShardLoader
from loaders.train import main
from tests.loaders.train import model_factories

FACTORIES = "tests.loaders.train.model_factories"


def _argv(data: Path, out: Path, *extra: str) -> list[str]:
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
        *extra,
    ]


def _label_counts(data: Path, channel: str) -> list[int]:
    labels = torch.cat([lab for _, lab in ShardLoader(str(data), channel=channel, batch_size=5)])
    return torch.bincount(labels[labels != PAD_LABEL], minlength=3).tolist()


def test_a_model_factory_replaces_the_small_cnn(tmp_path: Path):
    data, out = tmp_path / "ds", tmp_path / "out"
    write_dataset(data, rows={"train": 16, "validation": 6, "test": 6})
    assert main(_argv(data, out, "--model", f"{FACTORIES}:linear")) == 0
    ckpt = torch.load(io.BytesIO((out / "checkpoint.pt").read_bytes()), weights_only=True)
    assert set(ckpt["model"]) == {"fc.weight", "fc.bias"}
    assert ckpt["model"]["fc.weight"].shape == (3, 3 * 8 * 8)
    assert ckpt["config"]["model"] == f"{FACTORIES}:linear"


def test_metrics_have_top1_and_per_class_accuracy_for_validation_and_test(tmp_path: Path):
    data, out = tmp_path / "ds", tmp_path / "out"
    write_dataset(data, rows={"train": 16, "validation": 14, "test": 10}, num_classes=3)
    assert main(_argv(data, out, "--model", f"{FACTORIES}:always_class_1", "--epochs", "2")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    results = {
        "test": metrics["test"],
        **{f"validation {e['epoch']}": e["validation"] for e in metrics["epochs"]},
    }
    assert len(results) == 3
    for name, result in results.items():
        counts = _label_counts(data, name.split()[0])
        assert counts[1] > 0 and sum(counts) == (14 if name != "test" else 10)
        per_class = result["per_class"]
        assert list(per_class) == ["class0", "class1", "class2"]
        assert [c["count"] for c in per_class.values()] == counts, name
        assert [c["correct"] for c in per_class.values()] == [0, counts[1], 0], name
        assert [c["accuracy"] for c in per_class.values()] == [0.0, 1.0, 0.0], name
        assert result["top1"] == pytest.approx(counts[1] / sum(counts))
    assert [e["val_accuracy"] for e in metrics["epochs"]] == [
        e["validation"]["top1"] for e in metrics["epochs"]
    ]
    assert metrics["test_accuracy"] == metrics["test"]["top1"]


def test_a_class_without_rows_has_a_null_accuracy_and_metrics_json_is_strict_json(tmp_path: Path):
    data, out = tmp_path / "ds", tmp_path / "out"
    write_dataset(
        data, rows={"train": 16, "validation": 2, "test": 2}, num_classes=3
    )  # 2 rows: 2 of 3 classes
    assert main(_argv(data, out, "--model", f"{FACTORIES}:always_class_1")) == 0

    def refuse(constant: str) -> None:  # NaN and Infinity are not JSON: other readers refuse them
        raise AssertionError(f"metrics.json holds {constant}")

    per_class = json.loads((out / "metrics.json").read_text(), parse_constant=refuse)["test"]["per_class"]
    counts = _label_counts(data, "test")
    assert [c["count"] for c in per_class.values()] == counts and sorted(counts) == [0, 1, 1]
    for i, c in enumerate(per_class.values()):
        assert (c["accuracy"] is None) == (counts[i] == 0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nodots", r"--model \(command line\): expected package\.module:factory, .* got 'nodots'"),
        (
            "no_such_pkg.models:net",
            r"--model 'no_such_pkg\.models:net': cannot import no_such_pkg\.models: "
            r"ModuleNotFoundError: No module named 'no_such_pkg'",
        ),
        (f"{FACTORIES}:missing", rf"--model '{FACTORIES}:missing': {FACTORIES} has no attribute 'missing'"),
        (f"{FACTORIES}:NOT_CALLABLE", r"NOT_CALLABLE is not callable \(it is a int\)"),
        (f"{FACTORIES}:not_a_module", r"not_a_module\(3, 8\) returned a list, not a torch\.nn\.Module$"),
        (
            f"{FACTORIES}:needs_rgb_size_32",
            r"needs_rgb_size_32\(3, 8\) failed: ValueError: this network is for 32x32 images, not 8x8$",
        ),
    ],
    ids=["no-colon", "no-module", "no-attribute", "not-callable", "not-a-module", "factory-raises"],
)
def test_a_bad_model_is_one_error_line_and_status_2(tmp_path: Path, capsys, value: str, message: str):
    data, out = tmp_path / "ds", tmp_path / "out"
    write_dataset(data)
    assert main(_argv(data, out, "--model", value)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m loaders.train: error: "), lines
    assert re.search(message, lines[0]), lines[0]
    assert not out.exists()


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_precision_bf16_runs_the_forward_pass_under_autocast(
    tmp_path: Path, precision: str, dtype: torch.dtype
):
    data, out = tmp_path / "ds", tmp_path / "out"
    write_dataset(data, rows={"train": 16, "validation": 6, "test": 6})
    model_factories.SEEN_DTYPES.clear()
    assert main(_argv(data, out, "--model", f"{FACTORIES}:dtype_probe", "--precision", precision)) == 0
    assert model_factories.SEEN_DTYPES == {dtype}
    metrics = json.loads((out / "metrics.json").read_text())
    assert math.isfinite(metrics["epochs"][0]["loss"]) and 0.0 <= metrics["test_accuracy"] <= 1.0
    weights = torch.load(io.BytesIO((out / "checkpoint.pt").read_bytes()), weights_only=True)["model"]
    assert weights["fc.weight"].dtype == torch.float32  # autocast leaves the weights in fp32
