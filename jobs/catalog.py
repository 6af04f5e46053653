"""The manifest job's pure transform: inspected object rows -> labelled, split manifests.

No I/O and no engine here: the rows come from :mod:`jobs.listing` (run by any engine), the
tables go to :mod:`jobs.manifest` to be written.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from jobs.listing import reject as reject_row
from jobs.split import ALGORITHMS
from lakeshard.errors import ManifestError, RejectFractionError, SplitError
from lakeshard.format import MANIFEST_SCHEMA

__all__ = ["DUPLICATE", "Manifest", "build_manifest", "encode_labels", "fingerprint", "sagemaker_manifest"]

#: The reject reason's head of an object ``dedupe`` removed: "duplicate: same content as 'cat/1.jpg'".
DUPLICATE = "duplicate"
_EXAMPLES = 5


@dataclass(frozen=True)
class Manifest:
    """``all`` holds every listed object, sorted by key; ``channels`` the accepted rows of
    each channel; ``rejects`` the rest. ``counts[channel][label]`` is the class count.
    ``duplicates`` reports the accepted objects of identical content (see :func:`_duplicates`)."""

    all: pa.Table
    channels: dict[str, pa.Table]
    rejects: pa.Table
    labels: dict[str, int]
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    duplicates: dict[str, Any] = field(default_factory=dict)


def _same_content(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The groups (two or more, in key order) of ``rows`` with the same ``content`` hash."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("content"):
            groups[r["content"]].append(r)
    return [g for g in groups.values() if len(g) > 1]


def _dedupe(ok: Sequence[dict[str, Any]]) -> int:
    """Reject every object but the first (by key) of each group of identical content; return
    how many were rejected."""
    n = 0
    for group in _same_content(ok):
        for r in group[1:]:
            reject_row(r, f"{DUPLICATE}: same content as {group[0]['key']!r}")
            n += 1
    return n


def _duplicates(ok: Sequence[dict[str, Any]], removed: int) -> dict[str, Any]:
    """Accepted objects of identical content: how many groups and objects, how many groups
    span channels (leakage: the same image is trained on and evaluated) or labels, and a few
    examples of those; ``removed`` is how many ``dedupe`` rejected."""
    groups = _same_content(ok)
    leaks = [g for g in groups if len({r["channel"] for r in g}) > 1]
    mixed = [g for g in groups if len({r["label"] for r in g}) > 1]
    return {
        "groups": len(groups),
        "objects": sum(len(g) for g in groups),
        "across_channels": len(leaks),
        "across_labels": len(mixed),
        "examples": [{r["key"]: r["channel"] for r in g} for g in (leaks or groups)[:_EXAMPLES]],
        "removed": removed,
    }


def encode_labels(names: Sequence[str]) -> dict[str, int]:
    """Sorted label names -> 0..K-1."""
    return {name: i for i, name in enumerate(sorted(set(names)))}


def _check_min_per_class(counts: Mapping[str, Mapping[str, int]], labels: Sequence[str], minimum: int,
                         split_method: str) -> None:
    short = []
    for label in labels:
        got = {channel: counts[channel].get(label, 0) for channel in counts}
        if any(n < minimum for n in got.values()):
            short.append(f"{label!r} (" + ", ".join(f"{c}={n}" for c, n in got.items()) + ")")
    if short:
        raise SplitError(
            f"{len(short)} class(es) have fewer than min_per_class={minimum} objects in some channel: "
            + "; ".join(short)
            + ". Add images, lower --min-per-class or change --split"
            + (" (or use --split-method stratified for exact per-class counts)." if split_method == "hash" else "."))


def build_manifest(rows: Sequence[dict[str, Any]], *, split: Mapping[str, float], seed: int,
                   split_method: str = "hash", min_per_class: int = 1,
                   max_reject_fraction: float = 1.0, source: str = "", dedupe: bool = False) -> Manifest:
    """Label, split and check ``rows`` (from :func:`jobs.listing.inspect_objects`).

    With ``dedupe``, of the objects with identical content only the first by key is kept, the
    others are rejected naming it (those rejects do not count against ``max_reject_fraction``:
    they were asked for), so no content is in two channels.

    Raises :class:`SplitError` naming every class below ``min_per_class`` in some channel,
    :class:`RejectFractionError` when too much of the lake was rejected, and
    :class:`ManifestError` when fewer than two classes are left.
    """
    rows = sorted((dict(r) for r in rows), key=lambda r: r["key"])
    where = source or "the input"
    if not rows:
        raise ManifestError(f"no objects found under {where}")
    removed = _dedupe([r for r in rows if r["status"] == "ok"]) if dedupe else 0
    ok = [r for r in rows if r["status"] == "ok"]
    rejected, listed = len(rows) - len(ok) - removed, len(rows) - removed
    if rejected > max_reject_fraction * listed:
        reasons = Counter(r["reason"].split(":")[0] for r in rows
                          if r["status"] != "ok" and not r["reason"].startswith(DUPLICATE + ":"))
        top = ", ".join(f"{n}× {reason}" for reason, n in reasons.most_common(5))
        raise RejectFractionError(
            f"{rejected} of {listed} listed objects under {where} were rejected "
            f"({rejected / listed:.1%} > max_reject_fraction={max_reject_fraction:g}): {top}. "
            "See the reasons above, or raise --max-reject-fraction.")
    if not ok:
        raise ManifestError(f"no usable images under {where}")

    labels = encode_labels([r["label"] for r in ok])
    if len(labels) < 2:
        raise ManifestError(
            f"a classifier needs at least 2 classes, but {where} has usable images in 1 class only: "
            f"{next(iter(labels))!r}. Lay the lake out as <prefix>/<label>/.../<file> with a folder per class "
            "(or check --label-depth).")
    try:
        assign = ALGORITHMS[split_method]
    except KeyError:
        raise ManifestError(f"split_method must be one of {', '.join(ALGORITHMS)}, got {split_method!r}") from None
    channels = assign([r["key"] for r in ok], [r["label"] for r in ok], split, seed)
    for r, channel in zip(ok, channels):
        r["channel"] = channel
        r["label_index"] = labels[r["label"]]

    counts = {c: {label: 0 for label in labels} for c in split}
    for r in ok:
        counts[r["channel"]][r["label"]] += 1
    _check_min_per_class(counts, list(labels), min_per_class, split_method)

    table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)
    accepted = pa.Table.from_pylist(ok, schema=MANIFEST_SCHEMA)
    by_channel = {c: accepted.filter(pc.equal(accepted["channel"], c)) for c in split}
    rejects = table.filter(pc.equal(table["status"], "rejected"))
    return Manifest(all=table, channels=by_channel, rejects=rejects, labels=labels, counts=counts,
                    duplicates=_duplicates(ok, removed))


def fingerprint(table: pa.Table) -> str:
    """A content hash of the accepted rows (key, ETag, label, channel): the manifest's
    identity, from which the dataset version is derived."""
    h = hashlib.sha256()
    cols = [table[c].to_pylist() for c in ("key", "etag", "label", "channel", "status")]
    for key, etag, label, channel, status in zip(*cols):
        if status == "ok":
            h.update("\x1f".join((key, etag or "", label, channel)).encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()


def sagemaker_manifest(prefix: str, keys: Sequence[str]) -> list[Any]:
    """A SageMaker ``S3Prefix`` manifest: ``[{"prefix": "s3://b/raw/"}, "cat/1.jpg", ...]``."""
    return [{"prefix": prefix.rstrip("/") + "/"}, *keys]
