"""The report's section on labels beyond one class (:mod:`jobs.shard_steps.report_html`): a
multi-label or boxes dataset's labels per image, boxes per image and box sizes over one
channel's rows (its label columns only, never its images), the boxes the resize dropped, and a
few sample images with their labels and their boxes drawn over them (inline SVG)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow.parquet as pq

from jobs.shard_steps.report_parts import PALETTE, bar_chart, data_uri, esc, section
from lakeshard import storage
from lakeshard.format import DatasetInfo, channel_shards

__all__ = ["labels_section"]

#: Box size buckets: the square root of a box's area in pixels of the stored image, below each bound.
_SIZES = (4, 8, 16, 32, 64, 128, 256)


def _size_bucket(box: dict[str, Any]) -> str:
    side = (box["width"] * box["height"]) ** 0.5
    below = next((b for b in _SIZES if side < b), None)
    return f"< {below} px" if below is not None else f">= {_SIZES[-1]} px"


def _read(root: str, info: DatasetInfo, channel: str, columns: list[str]) -> list[dict[str, Any]]:
    """``columns`` of every row of ``channel``'s shards, pad copies left out."""
    rows = []
    for uri, _ in channel_shards(root, info, channel):
        fs, path = storage.filesystem(uri)
        table = pq.read_table(path, filesystem=fs, columns=[*columns, "is_pad"])
        rows += [r for r in table.to_pylist() if not r["is_pad"]]
    return rows


def _counts_chart(counts: Counter[Any], *, title: str, series: str) -> str:
    return bar_chart([(str(k), [v]) for k, v in sorted(counts.items())], series=[series], title=title)


def _sample(row: dict[str, Any], names: dict[int, str], scale: int) -> str:
    """One stored image at ``scale`` times its size, its boxes drawn over it, its labels below."""
    w, h = row["width"], row["height"]
    shapes = [f"<image href='{data_uri(row['image'])}' width='{w}' height='{h}'/>"]
    for box in row.get("boxes") or []:
        colour = PALETTE[box["label_index"] % len(PALETTE)]
        shapes.append(
            f"<rect x='{box['x']:.2f}' y='{box['y']:.2f}' width='{box['width']:.2f}' "
            f"height='{box['height']:.2f}' fill='none' stroke='{colour}' stroke-width='{1.5 / scale:.3f}'>"
            f"<title>{esc(box['label'])}</title></rect>"
        )
    labels = ", ".join(names.get(i, str(i)) for i in row["label_indices"]) or "no label"
    return (
        f"<figure class='sample'><svg xmlns='http://www.w3.org/2000/svg' width='{w * scale}' "
        f"height='{h * scale}' viewBox='0 0 {w} {h}' role='img' aria-label='{esc(row['key'])}'>"
        f"{''.join(shapes)}</svg><figcaption>{esc(labels)}</figcaption></figure>"
    )


def labels_section(root: str, info: DatasetInfo, channel: str, *, samples: int = 8) -> str:
    """The section for a multi-label or boxes dataset (empty for single-label): ``channel``'s
    labels per image, boxes per image and box sizes, the dropped boxes, and its first
    ``samples`` images with their boxes."""
    if info.task is None:
        return ""
    boxes = "boxes" in (info.columns or {})
    rows = _read(root, info, channel, ["label_indices", *(["boxes"] if boxes else [])])
    parts = [
        _counts_chart(
            Counter(len(r["label_indices"]) for r in rows),
            title="images by their number of labels",
            series="images",
        )
    ]
    if boxes:
        every = [b for r in rows for b in r["boxes"] or []]
        parts.append(
            _counts_chart(
                Counter(len(r["boxes"] or []) for r in rows),
                title="images by their number of boxes",
                series="images",
            )
        )
        sizes = Counter(_size_bucket(b) for b in every)
        parts.append(
            bar_chart(
                [
                    (k, [sizes[k]])
                    for k in sorted(sizes, key=lambda k: (k.startswith(">"), int(k.split()[1])))
                ],
                series=["boxes"],
                title="boxes by size (square root of the area, pixels of the stored image)",
                horizontal=True,
            )
        )
        dropped = (info.counts.dropped_boxes or {}).items()
        parts.append(
            f"<p>{len(every)} boxes in {len(rows)} images of {esc(channel)}; dropped by the resize: "
            + (", ".join(f"{esc(k)}: {v}" for k, v in dropped) or "none")
            + "</p>"
        )
    parts.append(_samples(root, info, channel, samples, boxes=boxes))
    return section(f"Labels and boxes ({info.task}, {channel})", "".join(parts))


def _samples(root: str, info: DatasetInfo, channel: str, n: int, *, boxes: bool) -> str:
    """The first ``n`` rows of ``channel``'s first shard (one row group read), drawn."""
    (uri, _), *_ = channel_shards(root, info, channel)
    fs, path = storage.filesystem(uri)
    columns = ["image", "key", "width", "height", "label_indices", *(["boxes"] if boxes else [])]
    with fs.open(path, "rb") as f:
        file = pq.ParquetFile(f)
        rows = file.read_row_group(0, columns=columns).slice(0, n).to_pylist() if file.num_row_groups else []
    names = {i: name for name, i in info.labels.items()}
    scale = max(1, 128 // max(info.image.size, 1))
    drawn = "".join(_sample(r, names, scale) for r in rows)
    return f"<h3>Samples, as stored</h3><div class='samples'>{drawn}</div>"
