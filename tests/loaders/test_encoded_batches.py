"""``decoder="none"``: batches of encoded images, for decoding on the GPU. The bytes are the rows
a decoding loader would decode, in its order, with its labels, and a state saved by either mode
resumes the other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from loader_builders import shard_path, write_dataset

from lakeshard.errors import ConfigError, LoaderError
from loaders import PAD_LABEL, EncodedBatch, ShardLoader
from loaders.decode import decode_simplejpeg

OPTIONS = {"batch_size": 4, "shuffle": True, "seed": 3, "shuffle_window": 10}


@pytest.fixture
def jpeg_dataset(tmp_path: Path) -> Path:
    """2 shards of JPEGs (every pixel of image i encodes i), 30 train rows, world size 2."""
    write_dataset(tmp_path, rows={"train": 30, "validation": 6, "test": 6}, num_shards=2, fmt="jpeg")
    return tmp_path


def _decoded(images: list[torch.Tensor]) -> torch.Tensor:
    """What the decoding loader yields for these bytes: uint8 [B, 3, H, W]."""
    return torch.stack([torch.from_numpy(decode_simplejpeg(i.numpy())) for i in images]).permute(0, 3, 1, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_bytes_are_the_rows_a_decoding_loader_decodes_in_its_order(jpeg_dataset: Path, rank: int):
    opts = {**OPTIONS, "rank": rank, "world_size": 2, "decoder": "simplejpeg"}
    decoding = ShardLoader(str(jpeg_dataset), **opts)
    encoded = ShardLoader(str(jpeg_dataset), **{**opts, "decoder": "none"})
    for epoch in (0, 1):
        decoding.set_epoch(epoch)
        encoded.set_epoch(epoch)
        pairs = list(zip(decoding, encoded, strict=True))
        assert len(pairs) == len(decoding) > 2
        for (images, labels), batch in pairs:
            assert isinstance(batch, EncodedBatch)
            assert all(i.dtype == torch.uint8 and i.dim() == 1 for i in batch.images)
            assert torch.equal(_decoded(batch.images), images)
            assert torch.equal(batch.labels, labels)
            # shards and rows name the Parquet row the bytes came from
            for image, shard, row in zip(
                batch.images, batch.shards.tolist(), batch.rows.tolist(), strict=True
            ):
                path = encoded.shard_uris[shard].removeprefix("file://")
                stored = pq.read_table(path, columns=["image"]).column("image")[row].as_py()
                assert bytes(image.numpy()) == stored


def test_a_state_saved_by_either_mode_resumes_the_other(jpeg_dataset: Path):
    decoding = ShardLoader(str(jpeg_dataset), **OPTIONS)
    rest = []
    for i, (_, labels) in enumerate(decoding):
        if i == 2:
            state = decoding.state_dict()
        elif i > 2:
            rest.append(labels)
    resumed = ShardLoader(str(jpeg_dataset), **OPTIONS, decoder="none")
    resumed.load_state_dict(state)
    got = [b.labels for b in resumed]
    assert len(got) == len(rest) > 0 and all(map(torch.equal, got, rest))

    encoded = ShardLoader(str(jpeg_dataset), **OPTIONS, decoder="none")
    it = iter(encoded)
    for _ in range(3):
        next(it)
    back = ShardLoader(str(jpeg_dataset), **OPTIONS)
    back.load_state_dict(encoded.state_dict())
    assert all(torch.equal(a, b.labels) for (_, a), b in zip(back, it, strict=True))


def test_bad_rows_are_what_the_decoding_loader_makes_of_them(tmp_path: Path):
    write_dataset(tmp_path, rows={"train": 8, "validation": 4, "test": 4}, num_shards=1, fmt="jpeg")
    path = shard_path(tmp_path, "train", 0, 1)
    table = pq.read_table(path)
    images = table.column("image").to_pylist()
    images[6] = None
    labels = table.column("label").to_pylist()
    labels[2] = 99
    for name, values in (("image", pa.array(images, pa.binary())), ("label", pa.array(labels, pa.int64()))):
        table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table, path, row_group_size=5)

    with (
        ShardLoader(str(tmp_path), batch_size=4, decoder="none") as failing,
        pytest.raises(LoaderError, match=r"label 99 out of range \[0, \d+\) at row 2 of .*part-00000"),
    ):
        list(failing)
    with ShardLoader(str(tmp_path), batch_size=4, decoder="none", skip_bad_rows=True) as loader:
        batches = list(loader)
    assert {s.row: s.reason for s in loader.skipped_rows} == {
        2: "label 99 out of range [0, 3)",
        6: "image is null",
    }
    flat = [(img, int(label)) for b in batches for img, label in zip(b.images, b.labels, strict=True)]
    assert [i for i, (_, label) in enumerate(flat) if label == PAD_LABEL] == [2, 6]
    assert flat[6][0].numel() == 0 and flat[2][0].numel() == 0
    assert all(
        np.asarray(img)[:3].tolist() == [0xFF, 0xD8, 0xFF] for img, label in flat if label != PAD_LABEL
    )


@pytest.mark.parametrize(
    "option",
    [{"augment": True}, {"crop": 4}, {"normalize": ((0.5,) * 3, (0.5,) * 3)}, {"pin_memory": True}],
    ids=lambda o: next(iter(o)),
)
def test_pixel_options_are_refused_with_the_bytes_mode(jpeg_dataset: Path, option: dict):
    name = next(iter(option))
    with pytest.raises(
        ConfigError, match=rf"decoder='none' yields the encoded images, so {name} cannot apply"
    ):
        ShardLoader(str(jpeg_dataset), decoder="none", **option)


def test_an_unknown_decoder_names_the_bytes_mode_too(jpeg_dataset: Path):
    with pytest.raises(
        ConfigError, match=r"decoder must be one of .* got 'gpu' \(or 'none': the encoded bytes\)"
    ):
        ShardLoader(str(jpeg_dataset), decoder="gpu")
