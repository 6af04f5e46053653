"""The manifest job's pure transform: inspected object rows -> labelled, split manifests.

No I/O and no engine here: the rows come from :mod:`jobs.listing` (run by any engine), the
tables go to :mod:`jobs.manifest` to be written.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from jobs.split import ALGORITHMS
from lakeshard.errors import ManifestError, RejectFractionError, SplitError
from lakeshard.format import MANIFEST_SCHEMA

__all__ = ["Manifest", "build_manifest", "encode_labels", "fingerprint", "sagemaker_manifest"]


@dataclass(frozen=True)
class Manifest:
    """``all`` holds every listed object, sorted by key; ``channels`` the accepted rows of
    each channel; ``rejects`` the rest. ``counts[channel][label]`` is the class count."""

    all: pa.Table
    channels: dict[str, pa.Table]
    rejects: pa.Table
    labels: dict[str, int]
    counts: dict[str, dict[str, int]] = field(default_factory=dict)


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
                   max_reject_fraction: float = 1.0, source: str = "") -> Manifest:
    """Label, split and check ``rows`` (from :func:`jobs.listing.inspect_objects`).

    Raises :class:`SplitError` naming every class below ``min_per_class`` in some channel,
    and :class:`RejectFractionError` when too much of the lake was rejected.
    """
    rows = sorted((dict(r) for r in rows), key=lambda r: r["key"])
    if not rows:
        raise ManifestError(f"no objects found under {source or 'the input'}")
    ok = [r for r in rows if r["status"] == "ok"]
    rejected = len(rows) - len(ok)
    if rejected > max_reject_fraction * len(rows):
        reasons = Counter(r["reason"].split(":")[0] for r in rows if r["status"] != "ok")
        top = ", ".join(f"{n}× {reason}" for reason, n in reasons.most_common(5))
        raise RejectFractionError(
            f"{rejected} of {len(rows)} listed objects under {source or 'the input'} were rejected "
            f"({rejected / len(rows):.1%} > max_reject_fraction={max_reject_fraction:g}): {top}. "
            "See the reasons above, or raise --max-reject-fraction.")
    if not ok:
        raise ManifestError(f"no usable images under {source or 'the input'}")

    labels = encode_labels([r["label"] for r in ok])
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
    return Manifest(all=table, channels=by_channel, rejects=rejects, labels=labels, counts=counts)


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
