"""Tiny datasets on disk that follow the contract in ``lakeshard/format/``, written without the
jobs (so loader tests run while the jobs are being written).

Every row's image is a flat colour that encodes a unique sample id: red = id mod 256, green =
id div 256. With PNG (lossless) :func:`ids_of` reads the ids back out of decoded batches, so
tests check *which* samples came out, through the real decode path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from lakeshard import format as contract

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
) -> dict[str, Any]:
    """Write a complete dataset under ``root``; return its ``dataset.json``.

    ``rows[channel]`` rows per channel (the remainder over ``num_shards`` is dropped);
    ``corrupt`` lists ``(channel, shard, row)`` whose image bytes are garbage; the last
    ``pad_rows`` rows of the last shard of each channel are marked ``is_pad``.
    """
    rows = rows or {"train": 40, "validation": 12, "test": 12}
    corrupt = set(corrupt)
    labels = {f"class{i}": i for i in range(num_classes)}
    channels: dict[str, Any] = {}
    for channel in contract.CHANNELS:
        total = rows.get(channel, 0)
        per_shard = total // num_shards
        shards = []
        for s in range(num_shards):
            ids = [CHANNEL_OFFSET[channel] + s * per_shard + j for j in range(per_shard)]
            images = [encode_image(i, size, fmt, noise=noise) for i in ids]
            for c_channel, c_shard, c_row in corrupt:
                if (c_channel, c_shard) == (channel, s):
                    images[c_row] = b"\xff\xd8\xff this is not an image"
            table = pa.table(
                {
                    "image": pa.array(images, pa.binary()),
                    "label": pa.array([i % num_classes for i in ids], pa.int64()),
                    "uri": pa.array([f"file:///raw/class{i % num_classes}/{i}.{fmt}" for i in ids], pa.string()),
                    "key": pa.array([f"class{i % num_classes}/{i}.{fmt}" for i in ids], pa.string()),
                    "height": pa.array([size] * per_shard, pa.int32()),
                    "width": pa.array([size] * per_shard, pa.int32()),
                    "is_pad": pa.array(
                        [s == num_shards - 1 and j >= per_shard - pad_rows for j in range(per_shard)], pa.bool_()
                    ),
                },
                schema=contract.SHARD_SCHEMA,
            )
            table = table.replace_schema_metadata(
                {
                    b"lakeshard.dataset_version": version.encode(),
                    b"lakeshard.channel": channel.encode(),
                    b"lakeshard.shard_index": str(s).encode(),
                    b"lakeshard.num_shards": str(num_shards).encode(),
                }
            )
            rel = f"shards/{channel}/{contract.shard_name(s, num_shards)}"
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path, row_group_size=row_group_rows)
            data = path.read_bytes()
            shards.append(
                {
                    "path": rel,
                    "rows": per_shard,
                    "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "row_groups": pq.ParquetFile(path).metadata.num_row_groups,
                }
            )
        channels[channel] = {"rows": per_shard * num_shards, "rows_per_shard": per_shard, "shards": shards}
    info = {
        "format_version": 1,
        "dataset_version": version,
        "labels": {str(i): i for i in range(num_classes)},
        "num_classes": num_classes,
        "image": {"size": size, "format": fmt, "quality": 95, "resize": "crop"},
        "num_shards": num_shards,
        "remainder": "drop",
        "seed": 7,
        "channels": channels,
    }
    (root / "labels.json").write_text(json.dumps(labels))
    tmp = root / "dataset.json.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, root / "dataset.json")
    return info
