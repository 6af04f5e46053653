"""Tiny datasets on disk, written through the format's own writer (``lakeshard.format``:
:class:`ShardWriter`, the layout's paths, :class:`DatasetInfo`) without the jobs, so loader
tests make exactly the rows they need.

Every row's image is a flat colour that encodes a unique sample id: red = id mod 256, green =
id div 256. With PNG (lossless) :func:`ids_of` reads the ids back out of decoded batches, so
tests check *which* samples came out, through the real decode path.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from PIL import Image

from lakeshard import format as contract
from lakeshard import storage

CHANNEL_OFFSET = {"train": 0, "validation": 20_000, "test": 40_000}


def encode_image(sample_id: int, size: int, fmt: str, *, noise: bool = False) -> bytes:
    arr = np.empty((size, size, 3), dtype=np.uint8)
    arr[..., 0] = sample_id % 256
    arr[..., 1] = (sample_id // 256) % 256
    arr[..., 2] = 17
    if noise:  # texture, for augmentation tests: every pixel differs
        rng = np.random.default_rng(sample_id)
        arr[..., 2] = rng.integers(0, 256, size=(size, size), dtype=np.uint8)
    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    else:
        Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def ids_of(images: torch.Tensor) -> list[int]:
    """Sample ids encoded in uint8 [B, 3, H, W] images."""
    red = images[:, 0, 0, 0].to(torch.int64)
    green = images[:, 1, 0, 0].to(torch.int64)
    return (red + 256 * green).tolist()


def shard_path(root: Path, channel: str, index: int, count: int) -> Path:
    """The local path of a shard of the dataset at ``root``."""
    return root / contract.shard_relpath(channel, index, count)


def write_dataset(
    root: Path,
    *,
    rows: dict[str, int] | None = None,
    num_shards: int = 2,
    size: int = 8,
    fmt: str = "png",
    num_classes: int = 3,
    row_group_rows: int = 5,
    version: str = "0123abcd",
    corrupt: Iterable[tuple[str, int, int]] = (),
    pad_rows: int = 0,
    noise: bool = False,
    first_id: int = 0,
    label_names: list[str] | None = None,
) -> contract.DatasetInfo:
    """Write a complete dataset under ``root``; return its ``dataset.json``.

    ``rows[channel]`` rows per channel (the remainder over ``num_shards`` is dropped);
    ``corrupt`` lists ``(channel, shard, row)`` whose image bytes are garbage; the last
    ``pad_rows`` rows of the last shard of each channel are marked ``is_pad``. Sample ids start
    at ``first_id`` (datasets meant to be mixed get ids apart); ``label_names`` replaces
    ``class0, class1, ...`` (the label of sample ``i`` is ``i % num_classes`` either way).
    """
    rows = rows or {"train": 40, "validation": 12, "test": 12}
    corrupt = set(corrupt)
    label_names = label_names or [f"class{i}" for i in range(num_classes)]
    labels = {name: i for i, name in enumerate(label_names[:num_classes])}
    names = {i: name for name, i in labels.items()}
    uri = storage.normalize(str(root))
    meta = {
        "dataset_version": version,
        "num_shards": num_shards,
        "format_version": contract.FORMAT_VERSION,
        "image_format": fmt,
        "image_size": size,
    }
    channels: dict[str, contract.ChannelInfo] = {}
    for channel in contract.CHANNELS:
        per_shard = rows.get(channel, 0) // num_shards
        shards = []
        for s in range(num_shards):
            ids = [first_id + CHANNEL_OFFSET[channel] + s * per_shard + j for j in range(per_shard)]
            images = [encode_image(i, size, fmt, noise=noise) for i in ids]
            for c_channel, c_shard, c_row in corrupt:
                if (c_channel, c_shard) == (channel, s):
                    images[c_row] = b"\xff\xd8\xff this is not an image"
            table = pa.table(
                {
                    "image": pa.array(images, pa.binary()),
                    "label": pa.array([i % num_classes for i in ids], pa.int64()),
                    "uri": pa.array(
                        [f"file:///raw/{names[i % num_classes]}/{i}.{fmt}" for i in ids], pa.string()
                    ),
                    "key": pa.array([f"{names[i % num_classes]}/{i}.{fmt}" for i in ids], pa.string()),
                    "height": pa.array([size] * per_shard, pa.int32()),
                    "width": pa.array([size] * per_shard, pa.int32()),
                    "is_pad": pa.array(
                        [s == num_shards - 1 and j >= per_shard - pad_rows for j in range(per_shard)],
                        pa.bool_(),
                    ),
                },
                schema=contract.SHARD_SCHEMA,
            )
            writer = contract.ShardWriter(
                contract.shard_uri(uri, channel, s, num_shards),
                metadata={**meta, "channel": channel, "shard_index": s},
                row_group_bytes=1 << 40,
                row_group_rows=row_group_rows,
            )
            with writer:
                writer.write(table)
            shards.append(contract.ShardInfo.from_stats(channel, s, num_shards, writer.stats, names))
        channels[channel] = contract.ChannelInfo.of_shards(shards)
    info = contract.DatasetInfo(
        format_version=contract.FORMAT_VERSION,
        dataset_version=version,
        created_at="2026-01-01T00:00:00+00:00",
        engine="tests.loaders.loader_builders",
        inputs=contract.Inputs(
            lake="file:///raw",
            manifest_fingerprint="0" * 16,
            split={c: 1 / len(contract.CHANNELS) for c in contract.CHANNELS},
            split_method="stratified",
            manifest_seed=7,
        ),
        seed=7,
        labels=labels,
        num_classes=num_classes,
        image=contract.ImageSpec(size=size, format=fmt, quality=95, resize="crop", max_pixels=1 << 24),
        num_shards=num_shards,
        remainder="drop",
        row_group_bytes=1 << 40,
        counts=contract.Counts(
            listed=sum(c.rows for c in channels.values()),
            manifest_rejects=0,
            shard_rejects=0,
            dropped=0,
            padded=0,
        ),
        build=contract.BuildInfo(preprocess_tasks=0, preprocessed=0, reused_segments=0, assembled_shards=0),
        channels=channels,
        rejects_path=contract.shard_rejects_relpath(),
        versions={"python": "3"},
    )
    storage.write_json_atomic(contract.labels_uri(uri), labels)
    storage.write_json_atomic(contract.dataset_json_uri(uri), info.to_json())
    return info


def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait until ``condition()`` holds; fail the test, saying ``what``, after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting ({timeout:.0f} s) until {what}")
        time.sleep(0.01)
