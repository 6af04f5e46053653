"""The key-value metadata in every shard's Parquet footer: which dataset version, channel and
shard the file is, so a reader can tell a shard of another build from its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lakeshard.errors import DatasetError

__all__ = ["FOOTER_KEYS", "PREFIX", "check_footer", "footer_metadata", "read_footer"]

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
    unknown = sorted(set(values) - set(FOOTER_KEYS))
    if unknown:
        raise ValueError(f"footer keys {unknown} are not in FOOTER_KEYS ({sorted(FOOTER_KEYS)})")
    return {f"{PREFIX}{k}": str(v) for k, v in values.items()}


def read_footer(metadata: Mapping[bytes, bytes] | None) -> dict[str, str]:
    """The ``lakeshard.*`` keys of a Parquet footer's key-value metadata, without the prefix."""
    prefix = PREFIX.encode()
    return {
        k[len(prefix) :].decode(): v.decode() for k, v in (metadata or {}).items() if k.startswith(prefix)
    }


def check_footer(uri: str, footer: Mapping[str, str], expected: Mapping[str, Any]) -> None:
    """Check that the footer (:func:`read_footer`) of the shard at ``uri`` says ``expected``.

    Raises:
        DatasetError: naming the first key that differs, both values and the shard; a
            ``dataset_version`` that differs says the dataset was rebuilt.
    """
    for key, want in expected.items():
        if key not in FOOTER_KEYS:
            raise ValueError(f"{key!r} is not a footer key ({sorted(FOOTER_KEYS)})")
        got = footer.get(key)
        if got != str(want):
            hint = " (the dataset was rebuilt since it was opened?)" if key == "dataset_version" else ""
            raise DatasetError(f"shard {uri} footer says {PREFIX}{key}={got!r}, expected {str(want)!r}{hint}")
