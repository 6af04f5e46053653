"""A self-contained HTML report of a dataset: ``<dataset>/report.html``.

The shard job writes it just after ``dataset.json`` (:func:`write_report`); a report that
cannot be written is a warning there, never a failed job. ``python -m jobs.report`` writes it
again (:mod:`jobs.report`). One HTML file, no
scripts and nothing fetched: counts, splits asked vs achieved, class counts per channel, rejects
with their reasons, shard balance, sample thumbnails (the shards' own encoded bytes as
``data:`` URIs), lineage (inputs, seed, versions, checksums). Charts are plain SVG drawn here,
so the report needs neither matplotlib nor a browser with scripts enabled.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import pyarrow.parquet as pq

from jobs.shard_steps.report_labels import labels_section
from jobs.shard_steps.report_parts import bar_chart, data_uri, esc, html_table, section
from lakeshard import storage
from lakeshard.format import (
    CHANNELS,
    DatasetInfo,
    ManifestInfo,
    channel_shards,
    manifest_marker_uri,
    read_manifest_info,
    rejects_uri,
)
from lakeshard.format.manifest_table import read_channel

__all__ = ["REPORT_NAME", "render_report", "report_uri", "write_report"]

log = logging.getLogger("jobs.report")

REPORT_NAME = "report.html"
_MAX_REJECT_ROWS = 50

#: Row groups read for the sample thumbnails at most, whatever the dataset's size: a class
#: with fewer than ``samples_per_class`` rows must not make the report read every shard.
_SAMPLE_ROW_GROUPS = 4


def report_uri(root: str) -> str:
    return storage.join(root, REPORT_NAME)


def write_report(root: str, info: DatasetInfo, *, samples_per_class: int = 6, max_classes: int = 24) -> str:
    """Write ``report.html`` into the dataset root ``root`` (atomically) and return its URI.

    ``info`` is the dataset's ``dataset.json`` (what the shard job wrote); the shards, rejects tables and
    manifests it describes must already be in place. Reads the rejects tables and, for the
    thumbnails, at most a few row groups of the shards, whatever the dataset's size.
    """
    uri = report_uri(root)
    page = render_report(root, info, samples_per_class=samples_per_class, max_classes=max_classes)
    storage.write_bytes_atomic(uri, page.encode("utf-8"))
    log.info("report written to %s (%d KiB)", uri, len(page) // 1024)
    return uri


def render_report(root: str, info: DatasetInfo, *, samples_per_class: int = 6, max_classes: int = 24) -> str:
    """The report's HTML, as one string."""
    root = storage.normalize(root)
    channels = [c for c in CHANNELS if c in info.channels] + [c for c in info.channels if c not in CHANNELS]
    labels = sorted(info.labels, key=lambda name: info.labels[name])
    manifest_rejects = read_channel(root, "rejects", columns=["key", "reason"]).to_pylist()
    shard_rejects = _read_optional(rejects_uri(root, info), ["key", "channel", "reason"])
    sections = [
        _summary(info, channels),
        _splits(info, channels),
        _class_counts(info, channels, labels),
        labels_section(root, info, "train" if "train" in channels else channels[0]),
        _rejects(manifest_rejects, shard_rejects),
        _lake(marker := _read_marker(root)),
        _incremental(marker, info),
        _shard_balance(info, channels, labels),
        _samples(root, info, channels, labels, per_class=samples_per_class, max_classes=max_classes),
        _lineage(info),
    ]
    title = f"lakeshard dataset {info.dataset_version}"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1><p class='muted'>{esc(root)} · created {esc(info.created_at)} "
        f"· engine {esc(info.engine)}</p>" + "".join(sections) + "</body></html>\n"
    )


# -- sections ----------------------------------------------------------------------------------------
def _summary(info: DatasetInfo, channels: list[str]) -> str:
    counts = info.counts
    rows: list[tuple[Any, ...]] = [
        ("objects listed in the lake", counts.listed),
        ("rejected by the manifest job", counts.manifest_rejects),
        ("rejected by the shard job", counts.shard_rejects),
        ("dropped by the remainder policy", counts.dropped),
        ("padding rows added", counts.padded),
    ]
    rows += [
        (f"rows in {c} ({info.num_shards} shards × {info.channels[c].rows_per_shard})", info.channels[c].rows)
        for c in channels
    ]
    image = info.image
    facts = (
        f"{info.num_classes} classes · images {image.size}×{image.size} {image.format} "
        f"(resize {image.resize}) · remainder policy <b>{esc(info.remainder)}</b>"
    )
    return section("Counts", f"<p>{facts}</p>" + html_table(["", "count"], rows))


def _splits(info: DatasetInfo, channels: list[str]) -> str:
    asked = info.inputs.split
    total = sum(info.channels[c].rows for c in channels) or 1
    rows, bars = [], []
    for c in channels:
        got = info.channels[c].rows / total
        want = asked.get(c)
        rows.append((c, f"{want:.3f}" if want is not None else "–", f"{got:.3f}", info.channels[c].rows))
        bars.append((c, [want or 0.0, got]))
    chart = bar_chart(
        bars,
        series=["asked", "achieved"],
        title="fraction of rows per channel",
        fmt="{:.3f}",
        horizontal=True,
    )
    return section(
        "Splits: asked vs achieved",
        html_table(["channel", "asked", "achieved", "rows"], rows)
        + chart
        + f"<p class='muted'>split method {esc(info.inputs.split_method)}</p>",
    )


def _class_counts(info: DatasetInfo, channels: list[str], labels: list[str]) -> str:
    groups = [(name, [info.channels[c].class_counts.get(name, 0) for c in channels]) for name in labels]
    chart = bar_chart(groups, series=channels, title="rows per class and channel")
    rows = [(name, *counts, sum(counts)) for name, counts in groups]
    return section("Classes per channel", chart + html_table(["class", *channels, "total"], rows))


def _rejects(manifest_rejects: list[dict[str, Any]], shard_rejects: list[dict[str, Any]]) -> str:
    everything = [("manifest", r) for r in manifest_rejects] + [("shard", r) for r in shard_rejects]
    if not everything:
        return section("Rejects", "<p>No object was rejected.</p>")
    by_reason = Counter(f"{stage}: {_reason_kind(r.get('reason'))}" for stage, r in everything)
    chart = bar_chart(
        [(k, [v]) for k, v in by_reason.most_common()],
        series=["objects"],
        title="rejected objects by reason",
        horizontal=True,
    )
    rows = [(stage, r.get("key") or "", r.get("reason") or "") for stage, r in everything[:_MAX_REJECT_ROWS]]
    more = len(everything) - len(rows)
    note = f"<p class='muted'>… and {more} more (see the rejects tables)</p>" if more > 0 else ""
    return section(f"Rejects ({len(everything)})", chart + html_table(["job", "key", "reason"], rows) + note)


def _lake(marker: ManifestInfo | None) -> str:
    """What the manifest job skipped (hidden or excluded objects) and the identical images it
    found under several keys, above all across channels (leakage)."""
    skipped = marker.counts.skipped if marker else 0
    dups = marker.duplicates if marker else None
    parts = []
    if marker and skipped:
        rows = list(marker.skipped_by_reason.items())
        examples = ", ".join(f"<code>{esc(k)}</code>" for k in list(marker.skipped_examples)[:5])
        parts.append(
            f"<p>{skipped} objects skipped, not rejected (hidden files, --exclude): e.g. {examples}</p>"
            + html_table(["why", "objects"], rows)
        )
    else:
        parts.append("<p>No object was skipped.</p>")
    if dups and dups.groups:
        leak = dups.across_channels
        warn = (
            f"<p class='warn'><b>Leakage:</b> {leak} set(s) of identical images span channels: the same image is "
            "trained on and evaluated. Rebuild the manifest with <code>--dedupe</code> to keep one copy.</p>"
            if leak
            else ""
        )
        removed = f" {dups.removed} copies were removed by --dedupe." if dups.removed else ""
        groups = [(", ".join(f"{k} ({c})" for k, c in group.items()),) for group in dups.examples]
        parts.append(
            warn + f"<p>{dups.objects} objects in {dups.groups} sets of identical content "
            f"({dups.across_labels} set(s) under different labels).{removed}</p>"
            + html_table(["identical objects (channel)"], groups)
        )
    else:
        parts.append("<p>No two accepted objects have the same content.</p>")
    return section("The lake: skipped objects and duplicates", "".join(parts) + _labels_table(marker))


def _incremental(marker: ManifestInfo | None, info: DatasetInfo) -> str:
    """What an incremental build (``--base``) took from its base: the manifest job's objects not
    read again, new, changed, gone and moved; the shard job's images reused and decoded. Empty
    for a build from scratch."""
    base, build = marker.base if marker else None, info.build
    if not base and build.base is None:
        return ""
    parts = []
    if base:
        left = ", ".join(f"<code>{esc(k)}</code>" for k in base.left_examples[:5])
        moved = ", ".join(f"<code>{esc(k)}</code>" for k in base.moved_examples[:5])
        parts.append(
            html_table(
                ["manifest job: --base " + base.root, "objects"],
                [
                    ("unchanged (same size and ETag)", base.unchanged),
                    ("of which not read again", base.reused),
                    ("new", base.new),
                    ("changed", base.changed),
                    ("left the lake", base.left),
                    ("moved to another channel", base.moved),
                ],
            )
        )
        if left:
            parts.append(f"<p>Left the lake, e.g. {left}</p>")
        if moved:
            parts.append(f"<p>Moved to another channel, e.g. {moved}</p>")
    if build.base is not None:
        parts.append(
            html_table(
                [f"shard job: --base {build.base.root} (version {build.base.dataset_version})", "images"],
                [
                    ("reused from the base's shards", build.reused),
                    ("fetched and decoded", build.preprocessed),
                ],
            )
        )
    return section("Incremental build", "".join(parts))


def _labels_table(marker: ManifestInfo | None) -> str:
    """What the ``--labels`` table left out: the objects it does not label (rejected) and its
    rows that name no object of the lake; empty for path labels."""
    table = marker.labels_table if marker else None
    if not table:
        return ""
    missing = table.not_in_lake
    examples = ", ".join(f"<code>{esc(k)}</code>" for k in table.not_in_lake_examples)
    rows = [
        ("rows in the table", table.rows),
        ("objects without a label row (rejected: no label)", table.unlabelled),
        ("objects pinned to a channel", table.pinned),
        ("label rows naming no object of the lake", missing),
    ]
    note = (
        f"<p class='warn'>{missing} label row(s) name no object under the input (e.g. {examples}).</p>"
        if missing
        else ""
    )
    return f"<h3>Labels from <code>{esc(table.uri)}</code></h3>" + note + html_table(["", "count"], rows)


def _read_marker(root: str) -> ManifestInfo | None:
    """The manifest job's summary (``manifests/_manifest.json``), or None if it cannot be read."""
    try:
        return read_manifest_info(root)
    except Exception as exc:  # the report describes what it can; the dataset is committed already
        log.warning("report: cannot read the manifest summary %s: %s", manifest_marker_uri(root), exc)
        return None


def _shard_balance(info: DatasetInfo, channels: list[str], labels: list[str]) -> str:
    parts, bars = [], []
    balance = "the shard job keeps it ≤ 1" if info.task is None else "images are balanced, not labels"
    for c in channels:
        shards = info.channels[c].shards
        spread = {name: _spread([s.class_counts.get(name, 0) for s in shards]) for name in labels}
        worst = max(spread.values(), default=0)
        rows = [(s.path, s.rows, _bytes(s.bytes), s.row_groups, s.sha256[:12]) for s in shards]
        parts.append(
            f"<h3>{esc(c)}</h3><p>rows per shard: {sorted({s.rows for s in shards})}; largest per-class "
            f"difference across shards: <b>{worst}</b> ({balance})</p>"
            + html_table(["shard", "rows", "size", "row groups", "sha256"], rows)
        )
        bars += [(f"{c} {i}", [s.rows]) for i, s in enumerate(shards)]
    chart = bar_chart(bars, series=["rows"], title="rows per shard", horizontal=True)
    return section("Shard balance", chart + "".join(parts))


def _samples(
    root: str, info: DatasetInfo, channels: list[str], labels: list[str], *, per_class: int, max_classes: int
) -> str:
    """Up to ``per_class`` thumbnails of each shown class, from at most
    :data:`_SAMPLE_ROW_GROUPS` row groups of the channel's shards, whatever the dataset's size:
    a class too rare to fill its row (or absent from them) shows fewer. A multi-label or boxes
    image shows under each of its labels."""
    channel = "train" if "train" in channels else channels[0]
    column = "label" if info.task is None else "label_indices"
    shown = labels[:max_classes]
    want = {info.labels[name]: name for name in shown}
    found: dict[int, list[bytes]] = {i: [] for i in want}
    budget = _SAMPLE_ROW_GROUPS
    for uri, _ in channel_shards(root, info, channel):
        if budget == 0 or all(len(v) >= per_class for v in found.values()):
            break
        fs, path = storage.filesystem(uri)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            for g in range(pf.metadata.num_row_groups):
                if budget == 0 or all(len(v) >= per_class for v in found.values()):
                    break
                budget -= 1
                table = pf.read_row_group(g, columns=["image", column])
                for data, held in zip(table["image"].to_pylist(), table[column].to_pylist()):
                    for label in held if isinstance(held, list) else [held]:
                        if label in found and len(found[label]) < per_class:
                            found[label].append(data)
    rows = []
    for index, name in want.items():
        imgs = "".join(f"<img class='thumb' alt='{esc(name)}' src='{data_uri(b)}'>" for b in found[index])
        rows.append(f"<tr><th>{esc(name)}</th><td>{imgs or '<span class=muted>none</span>'}</td></tr>")
    note = (
        f"<p class='muted'>first {len(shown)} of {len(labels)} classes</p>"
        if len(shown) < len(labels)
        else ""
    )
    return section(
        f"Samples ({channel}, as the loader reads them)",
        f"<table class='samples'>{''.join(rows)}</table>{note}",
    )


def _lineage(info: DatasetInfo) -> str:
    inputs, build = info.inputs, info.build
    image = dataclasses.asdict(info.image)
    rows: list[tuple[Any, ...]] = [
        ("dataset version", info.dataset_version),
        ("format version", info.format_version),
        ("lake", inputs.lake),
        ("manifest fingerprint", inputs.manifest_fingerprint),
        ("manifest seed", inputs.manifest_seed),
        ("shard seed", info.seed),
        ("split", ", ".join(f"{k}={v}" for k, v in sorted(inputs.split.items()))),
        ("image", ", ".join(f"{k}={v}" for k, v in sorted(image.items()))),
        ("row group bytes", _bytes(info.row_group_bytes)),
        ("engine", info.engine),
        (
            "build",
            f"{build.preprocessed} images decoded in {build.preprocess_tasks} tasks; "
            + (
                f"{build.reused_segments} segments reused from an interrupted run; "
                if build.reused_segments
                else ""
            )
            + f"{build.assembled_shards} shard files assembled afterwards",
        ),
    ]
    rows += [(f"version of {k}", v) for k, v in sorted(info.versions.items())]
    return section("Lineage", html_table(["", ""], rows))


# -- helpers -----------------------------------------------------------------------------------------
def _read_optional(uri: str, columns: list[str]) -> list[dict[str, Any]]:
    if not storage.exists(uri):
        return []
    fs, path = storage.filesystem(uri)
    table = pq.read_table(path, filesystem=fs)
    return table.select([c for c in columns if c in table.column_names]).to_pylist()


def _reason_kind(reason: str | None) -> str:
    """``cannot decode image …: truncated`` -> ``cannot decode image``: the reason's kind."""
    text = (reason or "unknown").split(":", 1)[0].strip()
    return text[:60] or "unknown"


def _spread(values: list[int]) -> int:
    return max(values) - min(values) if values else 0


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'DejaVu Sans',sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
h3{font-size:15px;margin:14px 0 4px}table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}thead th{background:#f4f4f4}
.muted{color:#777}figure{margin:8px 0}figcaption{color:#777;font-size:12px}
svg.chart{max-width:100%;height:auto;font:11px 'DejaVu Sans',sans-serif}
img.thumb{width:64px;height:64px;image-rendering:pixelated;margin:2px;border:1px solid #ccc}
table.samples td{border:none}table.samples th{border:none;text-align:right}
figure.sample{display:inline-block;margin:4px;vertical-align:top}figure.sample svg{border:1px solid #ccc}
.warn{background:#fff3cd;border:1px solid #e0c36c;padding:6px 10px}
"""
