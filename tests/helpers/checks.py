"""Checks of the dataset contract that several tests share; each reads what the jobs wrote."""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from typing import Any

import pyarrow.parquet as pq
from PIL import Image

from lakeshard import storage
from lakeshard.format import (
    SHARD_SCHEMA,
    DatasetInfo,
    channel_shards,
    check_footer,
    dataset_json_uri,
    expected_footer,
    labels_uri,
    read_dataset_info,
    read_footer,
    rejects_uri,
)
from lakeshard.format.manifest_table import read_channel, sagemaker_parts

__all__ = ["check_dataset", "read_table", "sagemaker_refs", "shard_tables"]


def read_table(uri: str):
    fs, path = storage.filesystem(uri)
    return pq.read_table(path, filesystem=fs)


def sagemaker_refs(root: str, channel: str) -> list[str]:
    """The ``source-ref`` of every line of a channel's SageMaker augmented manifest, in part order."""
    lines = [
        line
        for uri in sagemaker_parts(root, channel)
        for line in storage.read_bytes(uri).decode().splitlines()
    ]
    return [json.loads(line)["source-ref"] for line in lines]


def shard_tables(root: str, channel: str, num_shards: int) -> list[Any]:
    """The shards of ``channel``, read from where ``dataset.json`` names them; their channel
    folder holds them and nothing else (it reads as one table)."""
    shards = channel_shards(storage.normalize(root), read_dataset_info(root), channel)
    assert len(shards) == num_shards, shards
    folder = shards[0][0].rsplit("/", 1)[0]
    fs, path = storage.filesystem(folder)
    assert sorted(fs.ls(path, detail=False)) == sorted(storage.filesystem(u)[1] for u, _ in shards), folder
    return [read_table(uri) for uri, _ in shards]


def check_dataset(root: str, *, decode_images: bool = True) -> DatasetInfo:
    """Assert every invariant of DESIGN.md on the dataset at ``root``; return its dataset.json."""
    info = read_dataset_info(root)  # every field present and typed, the format version checked
    assert info.to_json() == json.loads(storage.read_bytes(dataset_json_uri(root)))  # no field lost
    labels = json.loads(storage.read_bytes(labels_uri(root)))
    assert info.labels == labels
    assert sorted(labels.values()) == list(range(len(labels)))
    assert list(labels) == sorted(labels)
    n = info.num_shards
    size = info.image.size

    all_rows = read_channel(root, "all")
    manifest_rejects = read_channel(root, "rejects")
    shard_rejects = read_table(rejects_uri(root, info))
    assert all(r for r in manifest_rejects["reason"].to_pylist())
    assert all(r for r in shard_rejects["reason"].to_pylist())

    # Every listed object ends in exactly one channel manifest, or in rejects.
    listed = all_rows["uri"].to_pylist()
    assert len(listed) == len(set(listed)) == info.counts.listed
    in_channels: list[str] = []
    for channel in info.channels:
        in_channels += read_channel(root, channel)["uri"].to_pylist()
    assert len(in_channels) == len(set(in_channels))
    assert sorted(in_channels + manifest_rejects["uri"].to_pylist()) == sorted(listed)

    for channel, entry in info.channels.items():
        manifest = read_channel(root, channel)
        # The SageMaker augmented manifest names the same objects, part by part, in the same order.
        assert sagemaker_refs(root, channel) == manifest["uri"].to_pylist()
        assert all(u.startswith(info.inputs.lake + "/") for u in manifest["uri"].to_pylist())
        tables = shard_tables(root, channel, n)
        rows = [t.num_rows for t in tables]
        assert rows == [entry.rows_per_shard] * n, (channel, rows)
        # Per-class counts differ across shards by at most one.
        per_shard = [Counter(t["label"].to_pylist()) for t in tables]
        for label in labels.values():
            counts = [c.get(label, 0) for c in per_shard]
            assert max(counts) - min(counts) <= 1, (channel, label, counts)
        # Accounting: manifest rows = shard rows (without padding) + shard rejects + dropped.
        shard_uris = [
            u for t in tables for u, pad in zip(t["uri"].to_pylist(), t["is_pad"].to_pylist()) if not pad
        ]
        assert len(shard_uris) == len(set(shard_uris))
        rejected = [
            u
            for u, c in zip(shard_rejects["uri"].to_pylist(), shard_rejects["channel"].to_pylist())
            if c == channel
        ]
        assert sorted(shard_uris + rejected + entry.dropped) == sorted(manifest["uri"].to_pylist())
        # The rows marked is_pad are exactly the copies dataset.json lists as padded (none
        # with the drop policy), one row per listed URI.
        pad_uris = [u for t in tables for u, pad in zip(t["uri"].to_pylist(), t["is_pad"].to_pylist()) if pad]
        assert Counter(pad_uris) == Counter(entry.padded), (channel, pad_uris, entry.padded)
        assert not pad_uris or info.remainder == "pad"
        # Labels in shards agree with the manifest.
        want = dict(zip(manifest["uri"].to_pylist(), manifest["label_index"].to_pylist()))
        for t in tables:
            assert all(want[u] == lab for u, lab in zip(t["uri"].to_pylist(), t["label"].to_pylist()))
        for i, (t, meta) in enumerate(zip(tables, entry.shards)):
            assert t.schema.remove_metadata().equals(SHARD_SCHEMA)
            check_footer(meta.path, read_footer(t.schema.metadata), expected_footer(info, channel, i))
            data = storage.read_bytes(storage.join(root, meta.path))
            assert hashlib.sha256(data).hexdigest() == meta.sha256
            assert len(data) == meta.bytes
            assert pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups == meta.row_groups
            if decode_images:
                for blob in t["image"].to_pylist():
                    img = Image.open(io.BytesIO(blob))
                    img.load()
                    assert img.mode == "RGB" and img.size == (size, size)
    assert info.counts.padded == sum(len(e.padded) for e in info.channels.values())
    assert info.counts.dropped == sum(len(e.dropped) for e in info.channels.values())
    return info
