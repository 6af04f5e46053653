"""The key-value metadata in every shard's Parquet footer: which dataset version, channel and
shard the file is, so a reader can tell a shard of another build from its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FOOTER_KEYS", "PREFIX", "footer_metadata", "read_footer"]

PREFIX = "lakeshard."

#: The keys every shard's footer carries (without :data:`PREFIX`), and what each says.
FOOTER_KEYS = {
    "dataset_version": "the dataset version the shard belongs to (dataset.json's dataset_version)",
    "channel": "the channel: train, validation or test",
    "shard_index": "the shard's index, 0 <= shard_index < num_shards",
    "num_shards": "how many shards the channel has",
    "format_version": "the format version the shard was written in",
    "image_format": "how the image column is encoded: jpeg or png",
    "image_size": "the height and width of every image, in pixels",
}


def footer_metadata(values: Mapping[str, Any]) -> dict[str, str]:
    """``{"lakeshard.<key>": str(value)}`` for the footer of a shard being written."""
    return {f"{PREFIX}{k}": str(v) for k, v in values.items()}


def read_footer(metadata: Mapping[bytes, bytes] | None) -> dict[str, str]:
    """The ``lakeshard.*`` keys of a Parquet footer's key-value metadata, without the prefix."""
    prefix = PREFIX.encode()
    return {k[len(prefix):].decode(): v.decode() for k, v in (metadata or {}).items() if k.startswith(prefix)}
