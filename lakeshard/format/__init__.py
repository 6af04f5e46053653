"""The dataset format: what is on disk, and the one place that reads and writes it.

``layout`` (paths and schemas), ``info`` (``dataset.json``), ``footer`` (a shard's footer keys),
``writer`` (:class:`ShardWriter`) and ``reader`` (the shard opener). See ``docs/format.md`` for
the specification.
"""

from lakeshard.format.footer import FOOTER_KEYS, check_footer, footer_metadata, read_footer
from lakeshard.format.info import (
    BuildInfo,
    ChannelInfo,
    Counts,
    DatasetInfo,
    ImageSpec,
    Inputs,
    ShardInfo,
    read_dataset_info,
)
from lakeshard.format.layout import (
    CHANNELS,
    FORMAT_VERSION,
    MANIFEST_SCHEMA,
    SHARD_REJECTS_SCHEMA,
    SHARD_SCHEMA,
    STORED_IMAGE_SIGNATURES,
    channel_dirname,
    dataset_json_uri,
    labels_uri,
    manifest_marker_uri,
    manifest_rejects_uri,
    manifests_uri,
    shard_name,
    shard_rejects_uri,
    shard_relpath,
    shard_uri,
    shards_folder_uri,
    shards_uri,
    stored_image_format,
)
from lakeshard.format.reader import OpenShard, channel_shards, expected_footer, open_shard
from lakeshard.format.writer import ShardWriter, write_shard_rejects

__all__ = [
    "CHANNELS",
    "FOOTER_KEYS",
    "FORMAT_VERSION",
    "MANIFEST_SCHEMA",
    "SHARD_REJECTS_SCHEMA",
    "SHARD_SCHEMA",
    "STORED_IMAGE_SIGNATURES",
    "BuildInfo",
    "ChannelInfo",
    "Counts",
    "DatasetInfo",
    "ImageSpec",
    "Inputs",
    "OpenShard",
    "ShardInfo",
    "ShardWriter",
    "channel_dirname",
    "channel_shards",
    "check_footer",
    "dataset_json_uri",
    "expected_footer",
    "footer_metadata",
    "labels_uri",
    "manifest_marker_uri",
    "manifest_rejects_uri",
    "manifests_uri",
    "open_shard",
    "read_dataset_info",
    "read_footer",
    "shard_name",
    "shard_rejects_uri",
    "shard_relpath",
    "shard_uri",
    "shards_folder_uri",
    "shards_uri",
    "stored_image_format",
    "write_shard_rejects",
]
