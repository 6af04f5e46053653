"""``python -m loaders.train`` on a multi-label dataset (binary cross-entropy, average precision
per class and its mean in ``metrics.json``), and its one-line refusal of a boxes dataset."""

from __future__ import annotations

import json
from pathlib import Path

from loader_builders import labels_of, write_dataset

from loaders.train.loop import main

BASE = ["--batch-size", "16", "--no-progress", "--num-threads", "2", "--width", "8"]


def test_a_multi_label_model_learns_the_shapes(tmp_path: Path, capsys):
    data = tmp_path / "ds"
    rows = {"train": 192, "validation": 32, "test": 64}
    write_dataset(data, rows=rows, size=16, num_classes=4, task="multi-label")
    out = tmp_path / "out"
    assert main(["--dataset", str(data), *BASE, "--epochs", "4", "--output", str(out)]) == 0
    assert "test mean average precision" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    test = metrics["test"]
    assert metrics["test_accuracy"] is None and set(test["per_class"]) == {f"class{c}" for c in range(4)}
    ids = range(40_000, 40_064)  # the test channel's samples
    for c in range(4):
        positives = sum(c in labels_of(i, 4) for i in ids)
        assert test["per_class"][f"class{c}"]["positives"] == positives
    # Chance (scores that ignore the image) is each class's share of rows: 3/8 here.
    assert test["mean_average_precision"] > 0.8, test
    assert metrics["epochs"][-1]["validation"]["mean_average_precision"] is not None
    assert metrics["epochs"][-1]["loss"] < metrics["epochs"][0]["loss"]


def test_a_boxes_dataset_is_refused_in_one_line_naming_the_loader_example(tmp_path: Path, capsys):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 8, "validation": 2, "test": 2}, size=16, task="boxes")
    assert main(["--dataset", str(data), *BASE, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a boxes dataset" in err[0] and "docs/loader.md" in err[0], err


def test_a_mixture_of_multi_label_datasets_trains_and_scores_each_class_by_name(tmp_path: Path, capsys):
    """B's class ``c`` is ``class{c+1}``: the test channels of both count each class's rows by
    name (B's relabelled into the mixture's label space)."""
    rows = {"train": 96, "validation": 16, "test": 32}
    write_dataset(tmp_path / "a", rows=rows, size=16, num_classes=4, task="multi-label")
    names = ["class1", "class2", "class3"]
    write_dataset(
        tmp_path / "b", rows=rows, size=16, num_classes=3, task="multi-label", first_id=1000,
        label_names=names, version="b0b0b0b0",
    )  # fmt: skip
    out = tmp_path / "out"
    mix = ["--dataset", str(tmp_path / "a"), "--dataset", str(tmp_path / "b")]
    assert main([*mix, *BASE, "--epochs", "2", "--output", str(out)]) == 0
    assert "test mean average precision" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    expected = {f"class{c}": sum(c in labels_of(i, 4) for i in range(40_000, 40_032)) for c in range(4)}
    for i in range(41_000, 41_032):
        for c in labels_of(i, 3):
            expected[names[c]] += 1
    assert {k: v["positives"] for k, v in metrics["test"]["per_class"].items()} == expected
    assert [s["rows"] for s in metrics["epochs"][-1]["sources"]] == [96, 96]
