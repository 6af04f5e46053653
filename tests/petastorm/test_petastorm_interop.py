"""petastorm (0.12.1, in .venv-petastorm) reads the shards our jobs wrote: ``make_batch_reader``
and ``petastorm.pytorch.DataLoader``, decoding the ``image`` column with
:func:`loaders.petastorm_compat.make_transform_spec`. Every row arrives exactly once, with its
label and its pixels."""

from __future__ import annotations

import hashlib
import io
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

try:
    from petastorm import make_batch_reader
    from petastorm.pytorch import DataLoader
except ImportError as exc:  # loud, never a skip: this folder runs in its own environment
    raise ImportError(
        f"{exc}: run tests/petastorm with .venv-petastorm/bin/python -m pytest tests/petastorm "
        "(scripts/setup_petastorm.sh creates it)"
    ) from exc

from lakeshard import storage
from lakeshard.format import DatasetInfo, channel_shards, read_dataset_info
from loaders.petastorm_compat import make_transform_spec

pytestmark = [pytest.mark.petastorm, pytest.mark.filterwarnings("ignore::FutureWarning:petastorm")]


def _shard_urls(root: Path, info: DatasetInfo, channel: str) -> list[str]:
    return [uri for uri, _ in channel_shards(storage.normalize(str(root)), info, channel)]


def _expected(root: Path, info: DatasetInfo, channel: str) -> dict[str, tuple[int, np.ndarray]]:
    """uri -> (label, pixels) of every row that is not padding, read with plain pyarrow + Pillow."""
    rows: dict[str, tuple[int, np.ndarray]] = {}
    for s in info.channels[channel].shards:
        t = pq.read_table(root / s.path, columns=["image", "label", "uri", "is_pad"])
        for data, label, uri, pad in zip(*(t[c].to_pylist() for c in ("image", "label", "uri", "is_pad"))):
            if not pad:
                assert uri not in rows, f"{uri} is twice in the shards without is_pad"
                rows[uri] = (label, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    return rows


def _manifest_labels(root: Path, channel: str) -> dict[str, int]:
    t = pq.read_table(root / "manifests" / channel, columns=["uri", "label_index"])  # a folder of parts
    return dict(zip(t["uri"].to_pylist(), t["label_index"].to_pylist()))


@pytest.fixture(scope="module")
def info(petastorm_dataset: Path) -> DatasetInfo:
    return read_dataset_info(str(petastorm_dataset))


def test_the_dataset_has_padding_and_several_row_groups(petastorm_dataset: Path, info: DatasetInfo):
    # What the other tests rely on to mean something: pad rows to drop, row groups to interleave.
    assert info.remainder == "pad" and info.counts.padded > 0
    assert max(s.row_groups for s in info.channels["train"].shards) >= 2


@pytest.mark.parametrize("channel", ["train", "validation", "test"])
def test_batch_reader_yields_every_row_once(petastorm_dataset: Path, info: DatasetInfo, channel: str):
    size = info.image.size
    expected = _expected(petastorm_dataset, info, channel)
    manifest = _manifest_labels(petastorm_dataset, channel)
    spec = make_transform_spec(size, fields=("uri", "label", "image"))
    seen: list[str] = []
    with make_batch_reader(
        _shard_urls(petastorm_dataset, info, channel),
        transform_spec=spec,
        num_epochs=1,
        reader_pool_type="thread",
        workers_count=3,
        shuffle_row_groups=True,
        seed=1,
    ) as reader:
        for batch in reader:
            assert batch.image.dtype == np.uint8 and batch.image.shape[1:] == (size, size, 3)
            for uri, label, image in zip(batch.uri, batch.label, batch.image):
                uri = str(uri)
                seen.append(uri)
                assert label == expected[uri][0] == manifest[uri], uri
                assert np.array_equal(image, expected[uri][1]), uri
    assert sorted(seen) == sorted(expected)  # every row, each once (Counter-equal: no duplicates)
    pads = _pads(petastorm_dataset, info, channel)
    assert pads == len(info.channels[channel].padded)
    assert len(seen) == info.channels[channel].rows - pads


def _digest(image: np.ndarray, label: int) -> str:
    return hashlib.sha256(
        np.ascontiguousarray(image).tobytes() + int(label).to_bytes(8, "little", signed=True)
    ).hexdigest()


@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_pytorch_dataloader_yields_every_row_once(petastorm_dataset: Path, info: DatasetInfo, layout: str):
    import torch

    size = info.image.size
    expected = _expected(petastorm_dataset, info, "train")
    want = Counter(
        _digest(img if layout == "hwc" else img.transpose(2, 0, 1), label) for label, img in expected.values()
    )
    spec = make_transform_spec(size, layout=layout)
    got: Counter[str] = Counter()
    shape = (size, size, 3) if layout == "hwc" else (3, size, size)
    with make_batch_reader(
        _shard_urls(petastorm_dataset, info, "train"),
        transform_spec=spec,
        num_epochs=1,
        reader_pool_type="thread",
        workers_count=2,
    ) as reader:
        loader = DataLoader(reader, batch_size=16)
        for batch in loader:
            images, labels = batch["image"], batch["label"]
            assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == shape
            assert labels.dtype == torch.int64 and len(labels) == len(images) <= 16
            got.update(_digest(i.numpy(), int(lab)) for i, lab in zip(images, labels))
    assert got == want
    assert sum(got.values()) == info.channels["train"].rows - _pads(petastorm_dataset, info, "train")


def _pads(root: Path, info: DatasetInfo, channel: str) -> int:
    return sum(
        sum(pq.read_table(root / s.path, columns=["is_pad"])["is_pad"].to_pylist())
        for s in info.channels[channel].shards
    )


def test_transform_spec_checks_its_arguments():
    with pytest.raises(ValueError, match="size must be a positive integer, got 0"):
        make_transform_spec(0)
    with pytest.raises(ValueError, match="layout must be one of"):
        make_transform_spec(24, layout="nhwc")
    with pytest.raises(ValueError, match="fields must name shard columns"):
        make_transform_spec(24, fields=("image", "pixels"))


def test_a_wrong_size_fails_with_the_uri(petastorm_dataset: Path, info: DatasetInfo):
    spec = make_transform_spec(info.image.size + 1, fields=("uri", "label", "image"))
    with (
        make_batch_reader(
            _shard_urls(petastorm_dataset, info, "test"),
            transform_spec=spec,
            num_epochs=1,
            reader_pool_type="dummy",
        ) as reader,
        pytest.raises(ValueError, match="cannot decode the image of file://"),
    ):
        next(iter(reader))


def test_reading_never_imports_pyspark():
    # pyspark is in .venv-petastorm for materialize_dataset (writing), but the make_batch_reader /
    # DataLoader path never imports it: a reader needs no Spark. Hold that (this runs last in the file).
    assert "pyspark" not in sys.modules
