"""A multi-label or boxes dataset through the loader: a named :class:`loaders.Batch` with the
rows' classes, boxes moved with the pixels by augment's crop and flip, the kept columns, and
every guarantee of a single-label dataset (equal batches per rank, exact and elastic resume,
``decoder="none"``, the DataLoader view, the preparation cluster; mixtures: ``test_task_mixtures.py``)."""

from __future__ import annotations

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
from loaders.transforms import Compose, RandomResizedCrop

ROWS = {"train": 46, "validation": 6, "test": 6}
OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 3, "shuffle_window": 16, "num_threads": 2}


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("boxes") / "ds"
    write_dataset(root, rows=ROWS, size=32, num_classes=3, task="boxes")
    return root


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multi") / "ds"
    write_dataset(root, rows=ROWS, size=16, num_classes=4, task="multi-label")
    return root


def _epoch(loader: ShardLoader, epoch: int = 0) -> list[Batch]:
    loader.set_epoch(epoch)
    return list(loader)


def test_a_multi_label_batch_names_its_fields(multi):
    with ShardLoader(str(multi), **OPTIONS) as loader:
        batches = _epoch(loader)
        assert len(batches) == len(loader)
    seen = []
    for batch in batches:
        assert isinstance(batch, Batch) and batch.boxes is None and "boxes" not in batch
        assert batch.labels.dtype == torch.float32 and batch.labels.shape == (len(batch.valid), 4)
        assert batch["images"] is batch.images and batch.images.dtype == torch.uint8
        for i, sample in enumerate(caption_ids(batch)):
            assert torch.nonzero(batch.labels[i]).flatten().tolist() == labels_of(sample, 4)
            assert batch["score"][i].item() == sample / 2
        seen += caption_ids(batch)
    assert sorted(seen) == list(range(46))


def test_boxes_come_out_where_the_shapes_are_after_augments_crop_and_flip(boxes):
    cut = 0
    with ShardLoader(str(boxes), **OPTIONS, augment=True, crop=20) as loader:
        for epoch in (0, 1):
            for batch in _epoch(loader, epoch):
                assert batch.images.shape[-2:] == (20, 20) and batch.boxes is not None
                for image, box, classes, sample in zip(
                    batch.images, batch.boxes, batch.box_labels, caption_ids(batch), strict=True
                ):
                    drawn = drawn_box(image)
                    if drawn is None:  # the crop left none of the shape: its box is dropped
                        assert box.shape == (0, 4) and classes.shape == (0,)
                        cut += 1
                        continue
                    assert box.shape == (1, 4) and classes.tolist() == [sample % 3]
                    assert np.allclose(box[0].tolist(), drawn, atol=1.0), (sample, box, drawn)
    assert cut  # it happened on these draws


def _half_lit(image: torch.Tensor) -> list[float] | None:
    """``x0, y0, x1, y1`` of the pixels whose blue is past half way from the background's (17)
    to the shape's (255): where a resampled shape's edges are, within a pixel."""
    ys, xs = torch.nonzero(image[2] > (17 + 255) / 2, as_tuple=True)
    if not len(xs):
        return None
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


def test_random_resized_crop_scales_boxes_with_the_window(boxes):
    rrc = Compose([RandomResizedCrop(24, scale=(0.3, 1.0))])
    compared = 0
    with ShardLoader(str(boxes), **OPTIONS, transform=rrc) as loader:
        for batch in loader:
            for image, box in zip(batch.images, batch.boxes, strict=True):
                lit = _half_lit(image)
                if lit is None:  # less than half a pixel of the shape is left
                    assert len(box) == 0 or min(box[0, 2] - box[0, 0], box[0, 3] - box[0, 1]) < 1.5
                    continue
                assert box.shape == (1, 4) and np.allclose(box[0].tolist(), lit, atol=1.0), (box, lit)
                compared += 1
    assert compared > 30


def test_the_flip_mirrors_boxes(boxes):
    sides = Counter()
    with ShardLoader(str(boxes), **OPTIONS, augment=True) as loader:
        for batch in loader:
            for image, box, sample in zip(batch.images, batch.boxes, caption_ids(batch), strict=True):
                x, y, w, h = box_of(sample, 32)
                mirrored = [32 - x - w, y, 32 - x, y + h]
                assert box.tolist() == [drawn_box(image)]
                sides[box[0].tolist() == mirrored and mirrored[0] != x] += 1
    assert sides[True] and sides[False]  # flipped and not, on these draws


def test_the_centre_crop_moves_boxes_and_without_one_they_are_as_stored(boxes):
    with ShardLoader(str(boxes), **OPTIONS) as plain:
        batch = next(iter(plain))
    for box, sample in zip(batch.boxes, caption_ids(batch), strict=True):
        x, y, w, h = box_of(sample, 32)
        assert box.tolist() == [[x, y, x + w, y + h]]
    with ShardLoader(str(boxes), **OPTIONS, crop=24) as centre:
        for batch in centre:
            for image, box in zip(batch.images, batch.boxes, strict=True):
                drawn = drawn_box(image)
                assert (drawn is None and len(box) == 0) or np.allclose(box[0].tolist(), drawn, atol=1.0)


def test_every_rank_yields_as_many_batches_and_pads_count_for_nothing(boxes):
    per_rank, real = [], Counter()
    for rank in range(3):
        with ShardLoader(str(boxes), **OPTIONS, rank=rank, world_size=3) as loader:
            batches = _epoch(loader)
            per_rank.append((len(batches), len(loader)))
        for batch in batches:
            pads = ~batch.valid
            assert batch.labels[pads].sum() == 0 and all(
                len(batch.boxes[i]) == 0 for i in np.flatnonzero(pads)
            )
            real.update(s for s, ok in zip(caption_ids(batch), batch.valid.tolist(), strict=True) if ok)
    assert len(set(per_rank)) == 1 and per_rank[0][0] == per_rank[0][1]
    assert sorted(real) == list(range(46))  # every row once; the rows repeated to even out are not valid


def test_an_exact_resume_yields_the_rest_of_the_epoch(boxes):
    kw = {**OPTIONS, "augment": True, "crop": 24}
    check_exact_resume(lambda: ShardLoader(str(boxes), **kw))


def test_an_elastic_resume_yields_every_row_once(boxes):
    kw = {**OPTIONS, "drop_last": False}
    assert ids_over_an_elastic_resume(lambda **at: ShardLoader(str(boxes), **{**kw, **at})) == list(range(46))


def test_decoder_none_yields_the_encoded_images_with_the_fields(boxes):
    with (
        ShardLoader(str(boxes), **OPTIONS) as decoded,
        ShardLoader(str(boxes), **OPTIONS, decoder="none") as encoded,
    ):
        for d, e in zip(decoded, encoded, strict=True):
            assert isinstance(e.images, list) and all(
                x.dtype == torch.uint8 and x.dim() == 1 for x in e.images
            )
            assert bytes(e.images[0][:4].tolist()) == b"\x89PNG"
            assert torch.equal(d.labels, e.labels) and caption_ids(d) == caption_ids(e)
            assert all(torch.equal(p, q) for p, q in zip(d.boxes, e.boxes, strict=True))


def test_the_dataloader_view_yields_the_named_batches(multi):
    with ShardLoader(str(multi), **OPTIONS) as loader:
        expected = _epoch(loader)
        view = torch.utils.data.DataLoader(loader.as_dataset(), batch_size=None, num_workers=0)
        got = list(view)
    assert all(isinstance(b, Batch) for b in got)
    assert [caption_ids(b) for b in got] == [caption_ids(b) for b in expected]


def _as_dict(images: torch.Tensor, batch: Batch) -> dict:
    return {"x": images, "y": batch.labels, "n": [len(b) for b in batch.boxes or []]}


def test_a_collate_of_ones_own_makes_the_batch(boxes):
    with ShardLoader(str(boxes), **OPTIONS, augment=True, crop=24, collate=_as_dict) as loader:
        batch = next(iter(loader))
    assert sorted(batch) == ["n", "x", "y"] and batch["x"].shape[-1] == 24 and len(batch["n"]) == 8


def test_collate_is_checked_and_refused_for_a_single_label_dataset(boxes, dataset):
    with pytest.raises(ConfigError, match="collate must be a callable") as bad:
        ShardLoader(str(boxes), collate=3)
    assert bad.value.option == "collate"
    with pytest.raises(ConfigError, match="is single-label"):
        ShardLoader(str(dataset), collate=_as_dict)


def test_a_label_index_out_of_range_is_a_bad_row(tmp_path):
    root = tmp_path / "ds"
    write_dataset(root, rows=ROWS, size=16, num_classes=4, task="multi-label")
    info = (root / "dataset.json").read_text()
    (root / "dataset.json").write_text(info.replace('"num_classes": 4', '"num_classes": 2'))
    with (
        ShardLoader(str(root), batch_size=8) as loader,
        pytest.raises(LoaderError, match=r"label index 2 out of range \[0, 2\) at row"),
    ):
        list(loader)
    with ShardLoader(str(root), batch_size=8, skip_bad_rows=True) as loader:
        batches = list(loader)
    assert not any(b.valid[i] and b.labels[i].sum() == 0 for b in batches for i in range(len(b.valid)))
    assert len(loader.skipped_rows) == sum(
        1 for i in range(46) if 2 in labels_of(i, 4) or 3 in labels_of(i, 4)
    )


def test_a_mixture_of_different_tasks_is_refused_naming_both(boxes, dataset, multi):
    with pytest.raises(DatasetError, match=r"sources \S*ds \(single-label\) and \S*ds \(boxes, columns "):
        MixedLoader([str(dataset), str(boxes)], batch_size=8)
    with pytest.raises(DatasetError, match=r"sources \S*ds \(multi-label, columns .*\) and \S*ds \(boxes, "):
        MixedLoader([str(multi), str(boxes)], batch_size=8)


def test_the_preparation_cluster_makes_the_named_batches(boxes, prep_cluster):
    kw = {**OPTIONS, "augment": True, "crop": 24}
    with (
        ShardLoader(str(boxes), **kw) as here,
        ShardLoader(str(boxes), **kw, prep=prep_cluster.scheduler_address) as far,
    ):
        assert_same_batches(_epoch(far), _epoch(here))
        assert far.batch_decoding.prep is not None and far.batch_decoding.prep.batches > 0


def test_a_remote_dataset_yields_the_local_batches_cached_or_not(boxes, s3_bucket, tmp_path):
    from tests.helpers.store import upload

    remote = upload(boxes, s3_bucket)
    kw = {**OPTIONS, "augment": True, "crop": 24}
    check_remote_alike(
        lambda: ShardLoader(str(boxes), **kw),
        lambda: ShardLoader(remote, **kw, cache_dir=str(tmp_path / "cache")),
    )
