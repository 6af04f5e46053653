"""What the shard job writes to ``dataset.json``: the dataset's identity (:func:`dataset_version`)
and its description (:func:`dataset_info`), built from the plans and the shard files' stats."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any

from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.deal import Deal
from jobs.shard_steps.staging import image_code, library_versions
from lakeshard.format import (
    FORMAT_VERSION,
    BuildInfo,
    ChannelInfo,
    Counts,
    DatasetInfo,
    ImageSpec,
    Inputs,
    ShardInfo,
)

__all__ = ["dataset_info", "dataset_version"]


def dataset_version(fingerprint: str, cfg: ShardConfig, seed: int, channels: list[str]) -> str:
    """The dataset's identity: a hash of the manifest's content and every option that changes
    the shards (not the engine: every engine writes the same dataset)."""
    spec = {"format_version": FORMAT_VERSION, "manifest": fingerprint, "num_shards": cfg.num_shards,
            "image": [cfg.image_size, cfg.resize, cfg.image_format, cfg.quality, cfg.max_image_pixels],
            "remainder": cfg.remainder, "seed": seed, "channels": channels}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def dataset_info(cfg: ShardConfig, *, marker: dict[str, Any], version: str, seed: int, engine: str,
                 deals: dict[str, Deal], named: dict[str, tuple[list[str], list[str]]], stats: list[dict[str, Any]],
                 reject_counts: dict[str, int], build: BuildInfo, rejects_path: str) -> DatasetInfo:
    """What ``dataset.json`` says. ``stats`` has one entry per shard file (its channel, shard
    index, path relative to the dataset root and :class:`~lakeshard.format.writer.ShardWriter`
    stats); ``named`` the URIs of each channel's dropped and padded rows (once per pad copy), by
    key; ``build`` says how this run made them (depends on the engine's parallelism, not part of
    the dataset's identity); ``rejects_path`` is where the shard rejects table goes, relative to
    the dataset root."""
    labels: dict[str, int] = marker["labels"]
    return DatasetInfo(
        format_version=FORMAT_VERSION,
        dataset_version=version,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        engine=engine,
        inputs=Inputs(lake=marker["input"], manifest_fingerprint=marker["fingerprint"], split=marker["split"],
                      split_method=marker["split_method"], manifest_seed=marker["seed"]),
        seed=seed,
        labels=labels,
        num_classes=len(labels),
        image=ImageSpec(size=cfg.image_size, format=cfg.image_format, quality=cfg.quality, resize=cfg.resize,
                        max_pixels=cfg.max_image_pixels, code=image_code()),
        num_shards=cfg.num_shards,
        remainder=cfg.remainder,
        row_group_bytes=cfg.row_group_size,
        counts=Counts(listed=marker["counts"]["listed"], manifest_rejects=marker["counts"]["rejected"],
                      shard_rejects=sum(reject_counts.values()),
                      dropped=sum(len(d.dropped) for d in deals.values()),
                      padded=sum(len(d.pads) for d in deals.values())),
        build=build,
        channels={c: _channel_info(c, deals[c], named[c], stats, labels, reject_counts[c]) for c in deals},
        rejects_path=rejects_path,
        versions=library_versions(),
    )


def _channel_info(channel: str, deal: Deal, named: tuple[list[str], list[str]], stats: list[dict[str, Any]],
                  labels: dict[str, int], rejected: int) -> ChannelInfo:
    names = {i: name for name, i in labels.items()}
    mine = sorted((s for s in stats if s["channel"] == channel), key=lambda s: s["shard"])
    dropped, padded = named
    return ChannelInfo.of_shards(
        [ShardInfo.from_stats(channel, s["shard"], deal.num_shards, s, names, path=s["path"]) for s in mine],
        rejected=rejected, dropped=dropped, padded=padded)
