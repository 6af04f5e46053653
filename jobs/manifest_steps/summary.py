"""What the manifest job hands between its last passes and says at the end: the checked counts,
the tables written, and ``manifests/_manifest.json`` (:class:`~lakeshard.format.ManifestInfo`)
built from them; the log lines and the console summary that report it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from jobs.manifest_steps.base import BaseReport
from jobs.manifest_steps.catalog import combine_fingerprints
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.duplicates import Duplicates
from jobs.manifest_steps.passes import ClassParts, ContentCounts, Listing
from lakeshard import storage
from lakeshard.format import (
    FORMAT_VERSION,
    MANIFEST_SCHEMA,
    TASK_FORMAT_VERSION,
    BaseSummary,
    ManifestCounts,
    ManifestInfo,
)
from lakeshard.format.label_columns import SINGLE_LABEL

__all__ = ["CheckedCounts", "TablesWritten", "log_written", "summarize", "summary_line", "warn_duplicates"]

log = logging.getLogger("jobs.manifest")


@dataclass(frozen=True, slots=True)
class CheckedCounts:
    """Pass 3's counts (:class:`~jobs.manifest_steps.passes.ContentCounts`), checked: the labels'
    indices, and ``counts[channel][label]`` as the split will make them."""

    content: ContentCounts
    labels: dict[str, int]
    counts: dict[str, dict[str, int]]


@dataclass(frozen=True, slots=True)
class TablesWritten:
    """What the passes that write the tables hand back: each class's fingerprint and the
    objects moved from their ``--base`` channel, and the groups of identical content."""

    classes: ClassParts
    duplicates: Duplicates


def summarize(
    cfg: ManifestConfig,
    listing: Listing,
    checked: CheckedCounts,
    written: TablesWritten,
    *,
    parts: int,
    base: BaseReport | None = None,
    columns: pa.Schema = MANIFEST_SCHEMA,
) -> ManifestInfo:
    """What ``manifests/_manifest.json`` says (``columns``: the manifest tables' schema). A
    single-label manifest's counts are those checked before the split; another's are those the
    split made (an image with several labels counts once per label in ``counts.classes``)."""
    single = cfg.task == SINGLE_LABEL
    counts = checked.counts if single else written.classes.counts.classes
    images = {c: sum(counts[c].values()) for c in counts}
    if not single:
        counts = {c: {label: counts.get(c, {}).get(label, 0) for label in checked.labels} for c in cfg.split}
        images = {c: written.classes.counts.images.get(c, 0) for c in cfg.split}
    added = {f.name: str(f.type) for f in columns if f.name not in MANIFEST_SCHEMA.names}
    achieved = {}
    for label in checked.labels:
        total = sum(counts[c].get(label, 0) for c in counts)
        achieved[label] = {c: round(counts[c].get(label, 0) / total, 4) for c in counts}
    listed, reasons = checked.content.listed, checked.content.reasons
    return ManifestInfo(
        format_version=FORMAT_VERSION if single else TASK_FORMAT_VERSION,
        input=storage.normalize(cfg.input),
        split=cfg.split,
        split_order=list(cfg.split),  # the channels' order (the hash split's slices are cut in it)
        split_method=cfg.split_method,
        seed=cfg.seed,
        min_per_class=cfg.min_per_class,
        label_depth=cfg.label_depth,
        # --labels: the table's URI, rows, objects it left unlabelled, rows naming no listed object.
        labels_table=listing.labels_table,
        # --base: its root and fingerprint; objects reused (not read), new, changed, left, moved.
        base=base.summary() if base is not None else None,
        labels=checked.labels,
        fingerprint=combine_fingerprints(written.classes.fingerprints),
        parts=parts,
        counts=ManifestCounts(
            listed=listed,
            accepted=listed - reasons.total(),
            rejected=reasons.total(),
            channels=images,
            classes=counts,
            skipped=listing.skipped.total(),
        ),
        achieved_fractions=achieved,
        rejects_by_reason=dict(sorted(reasons.items())),
        # "hidden" (their names vary without bound, as '._*' files do) or "excluded: --exclude GLOB".
        skipped_by_reason=dict(sorted(listing.skipped.items())),
        skipped_examples=dict(listing.skipped_examples),
        exclude=list(cfg.exclude),
        include_hidden=cfg.include_hidden,
        dedupe=cfg.dedupe,
        duplicates=written.duplicates.summary(),
        task=None if single else cfg.task,
        columns=added or None,
    )


def warn_duplicates(dups: Duplicates) -> None:
    found = dups.found
    if found.across_channels:
        log.warning(
            "leakage: %d groups of identical images are split across channels (%d objects in %d groups "
            "of identical content in all; e.g. %s); pass --dedupe to keep one of each",
            found.across_channels,
            found.objects,
            found.groups,
            dups.examples[0],
        )
    elif found.groups:
        log.warning(
            "%d objects in %d groups of identical content (each group within one channel; e.g. %s)",
            found.objects,
            found.groups,
            dups.examples[0],
        )
    if dups.removed:
        log.info("dedupe: rejected %d copies of identical content", dups.removed)


def log_written(out: str, summary: ManifestInfo) -> None:
    c = summary.counts
    log.info(
        "manifest written to %s: %d listed, %d accepted (%s), %d rejected",
        out,
        c.listed,
        c.accepted,
        ", ".join(f"{k}={v}" for k, v in c.channels.items()),
        c.rejected,
    )
    if base := summary.base:
        log.info("--base %s: %s", base.root, _base_counts(base))
        if base.relabelled:
            log.warning(
                "%d objects have another label than in --base %s (e.g. %s): each takes its new "
                "label, as a build without --base gives it",
                base.relabelled,
                base.root,
                _relabelled(base),
            )


def _relabelled(base: BaseSummary) -> str:
    return ", ".join(f"{e['key']}: {e['from']} -> {e['to']}" for e in base.relabelled_examples)


def _base_counts(base: BaseSummary) -> str:
    left = f" (e.g. {', '.join(base.left_examples)})" if base.left else ""
    relabelled = base.relabelled and f", {base.relabelled} relabelled (e.g. {_relabelled(base)})"
    return (
        f"{base.unchanged} unchanged ({base.reused} not read again), {base.new} new, {base.changed} "
        f"changed, {base.left} left the lake{left}, {base.moved} moved to another channel"
        f"{relabelled or ''}"
    )


def summary_line(cfg: ManifestConfig, summary: dict[str, Any]) -> str:
    info = ManifestInfo.from_json(summary)
    c = info.counts
    line = (
        f"manifest: {c.listed} listed, {c.accepted} accepted, {c.rejected} rejected, "
        f"{len(info.labels)} classes -> {storage.normalize(cfg.output)}"
    )
    return line + (f"\nbase {info.base.root}: {_base_counts(info.base)}" if info.base else "")
