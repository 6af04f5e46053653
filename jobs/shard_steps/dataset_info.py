"""What the shard job writes to ``dataset.json``: the dataset's identity (:func:`dataset_version`)
and its description (:func:`dataset_info`), built from each channel as built (:class:`BuiltChannel`:
its final plan and its shard files' stats)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.deal import Deal
from jobs.shard_steps.staging import image_code, library_versions
from lakeshard.format import (
    FORMAT_VERSION,
    BuildInfo,
    ChannelInfo,
    Counts,
    DatasetInfo,
    Inputs,
    ShardInfo,
)
from lakeshard.format.label_columns import SINGLE_LABEL

if TYPE_CHECKING:  # jobs.shard_steps.inputs names the dataset with dataset_version, below
    from jobs.shard_steps.inputs import ShardInputs

__all__ = ["BuiltChannel", "ShardFile", "dataset_info", "dataset_version"]


@dataclass(frozen=True, slots=True)
class ShardFile:
    """A shard file as the commit leaves it: its index, its path relative to the dataset root
    and its :attr:`~lakeshard.format.writer.ShardWriter.stats`."""

    index: int
    path: str
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BuiltChannel:
    """A channel as built: its final plan, its ``num_shards`` shard files (by index), how many
    of its manifest rows were rejected, and the URIs of the rows its plan dropped and padded
    (a padded row once per pad copy), by key."""

    name: str
    deal: Deal
    shards: tuple[ShardFile, ...]
    rejected: int
    dropped: tuple[str, ...]
    padded: tuple[str, ...]
    #: a ``boxes`` dataset: boxes its shards left out, by reason (:mod:`jobs.common.boxes`)
    dropped_boxes: Counter[str] = field(default_factory=Counter)


def dataset_version(
    fingerprint: str,
    cfg: ShardConfig,
    seed: int,
    channels: list[str],
    *,
    format_version: int = FORMAT_VERSION,
) -> str:
    """The dataset's identity: a hash of the manifest's content (its label columns included),
    the format version and every option that changes the shards (not the engine: every engine
    writes the same dataset)."""
    spec = {
        "format_version": format_version,
        "manifest": fingerprint,
        "num_shards": cfg.num_shards,
        "image": [cfg.image_size, cfg.resize, cfg.image_format, cfg.quality, cfg.max_image_pixels],
        "remainder": cfg.remainder,
        "seed": seed,
        "channels": channels,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def dataset_info(
    cfg: ShardConfig,
    job: ShardInputs,
    channels: list[BuiltChannel],
    build: BuildInfo,
    *,
    engine: str,
    rejects_path: str,
) -> DatasetInfo:
    """What ``dataset.json`` says of the dataset ``job`` names, built as ``channels`` say.
    ``build`` says how this run made them (depends on the engine's parallelism, not part of the
    dataset's identity); ``rejects_path`` is where the shard rejects table goes, relative to the
    dataset root."""
    marker = job.marker
    labels = marker.labels
    return DatasetInfo(
        format_version=job.columns.format_version,
        dataset_version=job.version,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        engine=engine,
        inputs=Inputs(
            lake=marker.input,
            manifest_fingerprint=marker.fingerprint,
            split=marker.split,
            split_method=marker.split_method,
            manifest_seed=marker.seed,
        ),
        seed=job.seed,
        labels=labels,
        num_classes=len(labels),
        image=replace(cfg.image_spec(), code=image_code()),
        num_shards=cfg.num_shards,
        remainder=cfg.remainder,
        row_group_bytes=cfg.row_group_size,
        counts=Counts(
            listed=marker.counts.listed,
            manifest_rejects=marker.counts.rejected,
            shard_rejects=sum(c.rejected for c in channels),
            dropped=sum(len(c.deal.dropped) for c in channels),
            padded=sum(len(c.deal.pads) for c in channels),
            dropped_boxes=dict(sorted(sum((c.dropped_boxes for c in channels), Counter()).items()))
            if job.columns.boxes
            else None,
        ),
        build=build,
        channels={c.name: _channel_info(c, labels) for c in channels},
        rejects_path=rejects_path,
        versions=library_versions(),
        task=None if job.columns.task == SINGLE_LABEL else job.columns.task,
        columns=job.columns.types(),
    )


def _channel_info(channel: BuiltChannel, labels: dict[str, int]) -> ChannelInfo:
    names = {i: name for name, i in labels.items()}
    shards = sorted(channel.shards, key=lambda s: s.index)
    return ChannelInfo.of_shards(
        [
            ShardInfo.from_stats(channel.name, s.index, channel.deal.num_shards, s.stats, names, path=s.path)
            for s in shards
        ],
        rejected=channel.rejected,
        dropped=list(channel.dropped),
        padded=list(channel.padded),
    )
