"""A mixture of multi-label or boxes datasets: every row of each source once an epoch in the
weights' proportions, each row's classes (multi-hot, and its boxes' classes) in the mixture's
label space by name, boxes where the shapes are after the crop and the flip, the kept columns
joined, exact and elastic resume, ``collate`` on the joined batch, a preparation cluster's
source batches and remote sources (cached or not) joined alike; sources that differ in their
columns refused naming both.

Source A's classes are ``class0..class2`` and B's ``class1..class3`` (B's class ``c`` is
``class{c+1}``): the mixture's label space is ``class0..class3`` and B's rows are relabelled.
Sample ids are apart (A: 0.., B: 1000..) and each row carries its id in its kept column
``caption``, so each row's expected classes and box follow from its id alone.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from loader_builders import (
    assert_same_batches,
    box_of,
    caption_ids,
    check_exact_resume,
    check_remote_alike,
    drawn_box,
    ids_over_an_elastic_resume,
    labels_of,
    write_dataset,
)

from lakeshard.errors import ConfigError, DatasetError, LoaderError
from loaders import Batch, MixedLoader, ShardLoader
from loaders.mixed_loader import Concatenated

B_FIRST = 1000
ROWS_A = {"train": 30, "validation": 4, "test": 4}
ROWS_B = {"train": 18, "validation": 4, "test": 4}
OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 3, "shuffle_window": 10, "num_threads": 2}
SPACE = ["class0", "class1", "class2", "class3"]


def _write(root: Path, task: str, *, other_names: bool, size: int) -> tuple[str, str]:
    write_dataset(root / "a", rows=ROWS_A, size=size, num_classes=3, task=task)
    names = ["class1", "class2", "class3"] if other_names else None
    write_dataset(
        root / "b", rows=ROWS_B, size=size, num_classes=3, task=task, first_id=B_FIRST,
        label_names=names, version="b0b0b0b0",
    )  # fmt: skip
    return str(root / "a"), str(root / "b")


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _write(tmp_path_factory.mktemp("multi"), "multi-label", other_names=True, size=16)


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _write(tmp_path_factory.mktemp("boxes"), "boxes", other_names=True, size=32)


@pytest.fixture(scope="module")
def boxes_alike(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Both sources with classes ``class0..class2``: no relabelling (rows decode alone)."""
    return _write(tmp_path_factory.mktemp("alike"), "boxes", other_names=False, size=32)


def _name(sample: int, c: int, *, other_names: bool = True) -> str:
    """The name of class ``c`` of ``sample``'s source."""
    return f"class{c + 1}" if sample % 20_000 >= B_FIRST and other_names else f"class{c}"


def _epoch(loader: MixedLoader, epoch: int) -> list[Batch]:
    loader.set_epoch(epoch)
    return list(loader)


def test_every_row_once_an_epoch_in_the_weights_proportions_with_its_classes_by_name(multi):
    world, seen = 2, Counter()
    for rank in range(world):
        with MixedLoader(list(multi), **OPTIONS, rank=rank, world_size=world) as loader:
            assert list(loader.labels) == SPACE and loader.per_source == [30, 18]
            batches = _epoch(loader, 1)
            assert len(batches) == len(loader) == 3
        for batch in batches:
            assert isinstance(batch, Batch) and batch.labels.shape == (8, 4) and bool(batch.valid.all())
            ids = caption_ids(batch)
            assert abs(sum(i >= B_FIRST for i in ids) - 18 / 48 * 8) <= 1 + 1 / world
            for i, sample in enumerate(ids):
                got = [SPACE[c] for c in torch.nonzero(batch.labels[i]).flatten().tolist()]
                assert got == sorted(_name(sample, c) for c in labels_of(sample, 3)), sample
                assert batch["score"][i].item() == sample / 2
            seen.update(ids)
    assert sorted(seen.elements()) == [*range(30), *range(B_FIRST, B_FIRST + 18)]


@pytest.mark.parametrize("fixture", ["boxes", "boxes_alike"])
def test_boxes_are_where_the_shapes_are_and_their_classes_by_name(fixture, request):
    """Relabelled and cropped (each source's batches decoded, then joined), and alike without a
    transform (each mixture batch decoded as one): each box where its shape's pixels are."""
    other = fixture == "boxes"
    transform = {"augment": True, "crop": 24} if other else {}
    rows = 0
    with MixedLoader(list(request.getfixturevalue(fixture)), **OPTIONS, **transform) as loader:
        assert loader.num_classes == (4 if other else 3)
        shards = [uri for src in loader.shard_sources for uri in src.shard_uris]
        for batch in _epoch(loader, 0):
            # each row's shard: an index into the sources' shards, one source after another
            assert [shards[k].split("/")[-4] for k in batch.shards.tolist()] == [
                "b" if i >= B_FIRST else "a" for i in caption_ids(batch)
            ]
            for image, box, classes, sample in zip(
                batch.images, batch.boxes, batch.box_labels, caption_ids(batch), strict=True
            ):
                drawn = drawn_box(image)
                if drawn is None:  # the crop left none of the shape: its box is dropped
                    assert box.shape == (0, 4) and classes.shape == (0,)
                    continue
                assert np.allclose(box.tolist(), [drawn], atol=1.0), (sample, box, drawn)
                assert [SPACE[c] for c in classes.tolist()] == [_name(sample, sample % 3, other_names=other)]
                if not other:
                    x, y, w, h = box_of(sample, 32)
                    assert box.tolist() == [[x, y, x + w, y + h]]
                rows += 1
    assert rows > 40


def test_an_exact_resume_yields_the_rest_of_the_epoch(boxes):
    kw = {**OPTIONS, "augment": True, "crop": 24}
    check_exact_resume(lambda: MixedLoader(list(boxes), **kw))


def test_an_elastic_resume_yields_every_row_once(multi):
    ids = ids_over_an_elastic_resume(lambda **at: MixedLoader(list(multi), **{**OPTIONS, **at}))
    assert ids == [*range(30), *range(B_FIRST, B_FIRST + 18)]


def _as_dict(images: torch.Tensor, batch: Batch) -> dict:
    return {"x": images, "y": batch.labels, "ids": caption_ids(batch)}


def test_collate_makes_the_joined_batch_and_is_refused_for_single_label_sources(multi, tmp_path):
    with MixedLoader(list(multi), **OPTIONS, collate=_as_dict) as loader:
        got = _epoch(loader, 0)
    assert all(sorted(b) == ["ids", "x", "y"] and b["y"].shape == (8, 4) for b in got)
    assert sorted(i for b in got for i in b["ids"]) == [*range(30), *range(B_FIRST, B_FIRST + 18)]
    write_dataset(tmp_path / "one")
    write_dataset(tmp_path / "two", first_id=B_FIRST)
    with pytest.raises(ConfigError, match="is single-label"):
        MixedLoader([str(tmp_path / "one"), str(tmp_path / "two")], batch_size=8, collate=_as_dict)


def test_sources_whose_kept_columns_differ_in_type_are_refused_naming_both(multi, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(multi[1], other)
    info = json.loads((other / "dataset.json").read_text())
    info["columns"]["score"] = "float"
    (other / "dataset.json").write_text(json.dumps(info))
    with pytest.raises(DatasetError, match=r"sources \S*a \(multi-label, .*score\) and \S*other \("):
        MixedLoader([multi[0], str(other)], batch_size=8)


def test_the_validation_channels_read_one_after_another_are_in_the_label_space(multi):
    loaders = [ShardLoader(uri, channel="validation", batch_size=4) for uri in multi]
    joined = Concatenated(loaders, {name: i for i, name in enumerate(SPACE)})
    try:
        batches = list(joined)
    finally:
        joined.close()
    rows = [(sample, batch.labels[i]) for batch in batches for i, sample in enumerate(caption_ids(batch))]
    assert len(rows) == 8
    for sample, multi_hot in rows:
        got = [SPACE[c] for c in torch.nonzero(multi_hot).flatten().tolist()]
        assert got == sorted(_name(sample, c) for c in labels_of(sample, 3))


def test_a_preparation_cluster_makes_each_sources_batches_and_the_mixture_joins_them(boxes, prep_cluster):
    kw = {**OPTIONS, "augment": True, "crop": 24}
    with (
        MixedLoader(list(boxes), **kw) as here,
        MixedLoader(list(boxes), **kw, prep=prep_cluster.scheduler_address) as far,
    ):
        assert_same_batches(_epoch(far, 1), _epoch(here, 1))
        assert far.prep is not None and far.prep.batches > 0 and far.prep.local_batches == 0


def test_remote_sources_yield_the_local_batches_cached_or_not(boxes, s3_bucket, tmp_path):
    from tests.helpers.store import upload

    remote = [upload(Path(uri), s3_bucket, prefix=Path(uri).name) for uri in boxes]
    kw = {**OPTIONS, "augment": True, "crop": 24}
    check_remote_alike(
        lambda: MixedLoader(list(boxes), **kw),
        lambda: MixedLoader(remote, **kw, cache_dir=str(tmp_path / "cache")),
    )


def _labels_only(images: torch.Tensor, batch: Batch, generator: torch.Generator) -> tuple:
    return images, batch.labels


def test_a_transform_that_drops_the_batch_is_refused_naming_the_source(multi):
    with (
        MixedLoader(list(multi), **OPTIONS, transform=_labels_only) as loader,
        pytest.raises(
            LoaderError,
            match=r"needs a loaders.Batch from each source of a multi-label dataset; \S+ gave tuple",
        ),
    ):
        next(iter(loader))
