"""The dataset format: what is on disk, and the one place that reads and writes it.

See ``docs/format.md`` for the specification.
"""

from lakeshard.format.footer import FOOTER_KEYS, footer_metadata, read_footer
from lakeshard.format.layout import (
    CHANNELS,
    FORMAT_VERSION,
    MANIFEST_SCHEMA,
    SHARD_REJECTS_SCHEMA,
    SHARD_SCHEMA,
    channel_dirname,
    dataset_json_uri,
    labels_uri,
    manifest_marker_uri,
    manifest_rejects_uri,
    manifests_uri,
    read_dataset_info,
    shard_name,
    shard_rejects_uri,
    shard_relpath,
    shard_uri,
    shards_uri,
)

__all__ = [
    "CHANNELS",
    "FOOTER_KEYS",
    "FORMAT_VERSION",
    "MANIFEST_SCHEMA",
    "SHARD_REJECTS_SCHEMA",
    "SHARD_SCHEMA",
    "channel_dirname",
    "dataset_json_uri",
    "footer_metadata",
    "labels_uri",
    "manifest_marker_uri",
    "manifest_rejects_uri",
    "manifests_uri",
    "read_dataset_info",
    "read_footer",
    "shard_name",
    "shard_rejects_uri",
    "shard_relpath",
    "shard_uri",
    "shards_uri",
]
