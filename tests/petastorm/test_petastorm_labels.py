"""petastorm (in .venv-petastorm) reads a multi-label dataset our jobs wrote: the field
``labels`` of :func:`loaders.petastorm_compat.make_transform_spec` is each row's
``label_indices`` as a multi-hot vector; a boxes dataset's ``boxes`` petastorm cannot read
(it leaves lists of structs out of its schema), which the docs say."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

try:
    from petastorm import make_batch_reader
    from petastorm.pytorch import DataLoader
except ImportError as exc:  # loud, never a skip: this folder runs in its own environment
    raise ImportError(
        f"{exc}: run tests/petastorm with .venv-petastorm/bin/python -m pytest tests/petastorm"
    ) from exc

from lakeshard import storage
from lakeshard.format import channel_shards, read_dataset_info
from loaders.petastorm_compat import make_transform_spec
from tests.helpers.shapes import shapes_lake
from tests.petastorm.conftest import run_job

pytestmark = [pytest.mark.petastorm, pytest.mark.filterwarnings("ignore::FutureWarning:petastorm")]


@pytest.fixture(scope="module")
def multi_label(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("petastorm-multi")
    drawn = shapes_lake(tmp / "lake", 60, seed=3)
    table = tmp / "labels.jsonl"
    table.write_text("".join(json.dumps({"key": d.key, "labels": d.labels}) + "\n" for d in drawn))
    out = tmp / "ds"
    run_job(
        "jobs.build",
        *("--engine", "local", "--input", str(tmp / "lake"), "--output", str(out), "--labels", str(table)),
        *("--task", "multi-label", "--split-method", "stratified", "--num-shards", "2", "--image-size", "16"),
    )
    return out


def test_a_multi_label_dataset_reads_as_multi_hot_labels(multi_label: Path) -> None:
    info = read_dataset_info(str(multi_label))
    assert info.task == "multi-label"
    want = {}
    for s in info.channels["train"].shards:
        t = pq.read_table(multi_label / s.path, columns=["key", "label_indices", "is_pad"])
        for key, indices, pad in zip(*(t[c].to_pylist() for c in ("key", "label_indices", "is_pad"))):
            if not pad:
                want[key] = sorted(indices)
    urls = [uri for uri, _ in channel_shards(storage.normalize(str(multi_label)), info, "train")]
    spec = make_transform_spec(16, layout="chw", fields=("image", "labels"), num_classes=info.num_classes)
    hot = []
    with make_batch_reader(urls, transform_spec=spec, num_epochs=1, workers_count=2) as reader:
        for batch in DataLoader(reader, batch_size=8):
            assert batch["image"].shape[1:] == (3, 16, 16)
            hot += [np.flatnonzero(row.numpy()).tolist() for row in batch["labels"]]
    assert sorted(hot) == sorted(want.values())  # every row once, its classes as stored
    assert any(len(h) > 1 for h in hot)


def test_labels_need_num_classes() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        make_transform_spec(16, fields=("image", "labels"))
