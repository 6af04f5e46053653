"""The report's HTML pieces (:mod:`jobs.shard_steps.report_html`): escaping, sections,
tables, bar charts as inline SVG and images as ``data:`` URIs; no scripts, nothing fetched."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from typing import Any

from lakeshard.format import stored_image_format

__all__ = ["PALETTE", "bar_chart", "data_uri", "esc", "html_table", "section"]

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948")


def data_uri(data: bytes) -> str:
    mime = f"image/{stored_image_format(data) or 'webp'}"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def section(title: str, body: str) -> str:
    return f"<section><h2>{esc(title)}</h2>{body}</section>"


def html_table(header: list[str], rows: list[tuple[Any, ...]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def bar_chart(
    groups: Sequence[tuple[str, Sequence[float]]],
    *,
    series: list[str],
    title: str,
    fmt: str = "{:g}",
    horizontal: bool = False,
) -> str:
    """Grouped bars as inline SVG: one group per ``(name, values)``, one bar per series."""
    if not groups:
        return ""
    top = max((v for _, values in groups for v in values), default=0) or 1
    k = len(series)
    legend = (
        "".join(
            f"<rect x='{10 + 110 * i}' y='8' width='12' height='12' fill='{PALETTE[i % len(PALETTE)]}'/>"
            f"<text x='{26 + 110 * i}' y='19'>{esc(s)}</text>"
            for i, s in enumerate(series)
        )
        if k > 1
        else ""
    )
    shapes = []
    if horizontal:
        bar, label_w, plot_w = 16, 200, 520
        width, height = label_w + plot_w + 60, 34 + len(groups) * (k * bar + 8)
        shapes.append(f"<line x1='{label_w}' y1='26' x2='{label_w}' y2='{height - 4}' stroke='#888'/>")
        for gi, (name, values) in enumerate(groups):
            y0 = 30 + gi * (k * bar + 8)
            shapes.append(
                f"<text x='{label_w - 6}' y='{y0 + k * bar / 2 + 4}' text-anchor='end'>{esc(name[:40])}</text>"
            )
            for si, v in enumerate(values):
                w = plot_w * v / top
                shapes.append(
                    f"<rect x='{label_w}' y='{y0 + si * bar}' width='{w:.1f}' height='{bar - 2}' "
                    f"fill='{PALETTE[si % len(PALETTE)]}'><title>{esc(name)}: {fmt.format(v)}</title></rect>"
                    f"<text x='{label_w + w + 4:.1f}' y='{y0 + si * bar + bar - 5}'>{fmt.format(v)}</text>"
                )
    else:
        bar = max(4, min(28, 900 // max(1, len(groups) * k)))
        group_w = k * bar + 10
        plot_h, base = 200, 240
        width, height = max(320, 40 + len(groups) * group_w), base + 40
        shapes.append(f"<line x1='30' y1='{base}' x2='{width - 4}' y2='{base}' stroke='#888'/>")
        for gi, (name, values) in enumerate(groups):
            x0 = 36 + gi * group_w
            for si, v in enumerate(values):
                h = plot_h * v / top
                shapes.append(
                    f"<rect x='{x0 + si * bar}' y='{base - h:.1f}' width='{bar - 1}' height='{h:.1f}' "
                    f"fill='{PALETTE[si % len(PALETTE)]}'><title>{esc(name)} {esc(series[si])}: "
                    f"{fmt.format(v)}</title></rect>"
                )
            shapes.append(
                f"<text x='{x0 + k * bar / 2}' y='{base + 16}' text-anchor='middle'>{esc(name[:12])}</text>"
            )
        shapes.append(f"<text x='28' y='{base - plot_h + 4}' text-anchor='end'>{fmt.format(top)}</text>")
    return (
        f"<figure><svg class='chart' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{esc(title)}'>{legend}{''.join(shapes)}</svg>"
        f"<figcaption>{esc(title)}</figcaption></figure>"
    )
