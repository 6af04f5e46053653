"""The manifest's rules: inspected object rows -> labelled, split manifests.

No I/O and no engine here. :func:`build_manifest` applies every rule to rows in memory: the
reference the distributed manifest job (:mod:`jobs.manifest_steps.passes`, which calls the same
pieces where the rows are) must agree with, and the builder for small inputs and tests.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from jobs.manifest_steps.listing import StagedRow
from jobs.manifest_steps.listing import reject as reject_row
from jobs.manifest_steps.split import ALGORITHMS, SplitFn
from lakeshard.errors import ManifestError, RejectFractionError, SplitError
from lakeshard.format import MANIFEST_SCHEMA

__all__ = [
    "DUPLICATE",
    "Manifest",
    "build_manifest",
    "case_twins",
    "check_accepted",
    "check_min_per_class",
    "combine_fingerprints",
    "content_id",
    "dedupe_rows",
    "encode_labels",
    "fingerprint",
    "fingerprint_line",
    "reason_kind",
    "same_content",
    "split_function",
]

log = logging.getLogger(__name__)

#: The reject reason's head of an object ``dedupe`` removed: "duplicate: same content as 'cat/1.jpg'".
DUPLICATE = "duplicate"
_EXAMPLES = 5
#: A label that is an integer (``"7"``, ``"-1"``, ``"007"``): if every label is one, they are
#: numbered in numeric order.
_INTEGER = re.compile(r"[+-]?[0-9]+")


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


def same_content(rows: Sequence[StagedRow]) -> list[list[StagedRow]]:
    """The groups (two or more, in key order) of ``rows`` with the same ``content`` hash."""
    groups: dict[str, list[StagedRow]] = defaultdict(list)
    for r in rows:
        if content := r.get("content"):
            groups[content].append(r)
    return [g for g in groups.values() if len(g) > 1]


def dedupe_rows(ok: Sequence[StagedRow]) -> int:
    """Reject every object but the first (by key) of each group of identical content; return
    how many were rejected."""
    n = 0
    for group in same_content(ok):
        for r in group[1:]:
            reject_row(r, f"{DUPLICATE}: same content as {group[0]['key']!r}")
            n += 1
    return n


def _duplicates(ok: Sequence[StagedRow], removed: int) -> dict[str, Any]:
    """Accepted objects of identical content: how many groups and objects, how many groups
    span channels (leakage: the same image is trained on and evaluated) or labels, and a few
    examples of those; ``removed`` is how many ``dedupe`` rejected."""
    groups = same_content(ok)
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


def encode_labels(names: Iterable[str]) -> dict[str, int]:
    """Label names -> 0..K-1: in numeric order if every name is an integer (``"2"`` before
    ``"10"``, so that integer classes keep the user's numbers when they are 0..K-1), else in
    text order. The one place class indices are made (``labels.json``, ``_manifest.json``, every
    row's ``label_index``), for every label source and with or without ``--base``."""
    unique = set(names)
    if unique and all(_INTEGER.fullmatch(n) for n in unique):
        return {name: i for i, name in enumerate(sorted(unique, key=lambda n: (int(n), n)))}
    return {name: i for i, name in enumerate(sorted(unique))}


def case_twins(names: Iterable[str]) -> list[list[str]]:
    """The groups (two or more names, sorted) of ``names`` that differ only by case or white
    space (``"Cat"``, ``"cat"``, ``"c at"``): distinct classes that are likely one."""
    groups: dict[str, set[str]] = defaultdict(set)
    for name in names:
        groups["".join(name.split()).casefold()].add(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def check_min_per_class(
    counts: Mapping[str, Mapping[str, int]], labels: Sequence[str], minimum: int, split_method: str
) -> None:
    """Raise :class:`SplitError` naming every class with fewer than ``minimum`` objects in some
    channel of ``counts`` (``counts[channel][label]``) and its counts; 0 checks nothing."""
    short = []
    for label in labels:
        got = {channel: counts[channel].get(label, 0) for channel in counts}
        if any(n < minimum for n in got.values()):
            short.append(f"{label!r} (" + ", ".join(f"{c}={n}" for c, n in got.items()) + ")")
    if not short:
        return
    if minimum > 1:
        fix = f"lower --min-per-class (now {minimum}; 0 lets a class be missing from a channel)"
    else:
        fix = (
            "pass --min-per-class 0 to let a class be missing from a channel (it is then absent from that "
            "channel's shards)"
        )
    raise SplitError(
        f"{len(short)} class(es) have fewer than --min-per-class {minimum} objects in some channel: "
        + "; ".join(short)
        + f". Add images, {fix}, or change --split"
        + (
            " (or use --split-method stratified for exact per-class counts)."
            if split_method == "hash"
            else "."
        )
    )


def reason_kind(reason: str) -> str:
    """A reject reason's kind: its text before the first ':' (``rejects_by_reason``'s keys)."""
    return reason.split(":")[0]


def split_function(split_method: str) -> SplitFn:
    try:
        return ALGORITHMS[split_method]
    except KeyError:
        raise ManifestError(
            f"split_method must be one of {', '.join(ALGORITHMS)}, got {split_method!r}"
        ) from None


def check_accepted(
    *,
    listed: int,
    reasons: Mapping[str, int],
    removed: int,
    ok_labels: Iterable[str],
    max_reject_fraction: float,
    where: str,
    label_source: str | None = None,
    min_classes: int = 2,
) -> dict[str, int]:
    """Check what the inspection left of ``listed`` objects (rejected: ``reasons``, by
    :func:`reason_kind`, ``removed`` of them by ``dedupe``, which do not count against
    ``max_reject_fraction``: they were asked for); return the labels of the accepted objects.

    Raises :class:`RejectFractionError` when too much of the lake was rejected, and
    :class:`ManifestError` when no object or fewer than ``min_classes`` classes are left
    (naming ``label_source``, the labels table or Ground Truth manifest, if the labels came
    from one; a detector of one class is fine: ``boxes`` manifests need one).
    """
    rejected, listed = sum(reasons.values()) - removed, listed - removed
    if rejected > max_reject_fraction * listed:
        common = sorted(
            ((n, reason) for reason, n in reasons.items() if reason != DUPLICATE), key=lambda x: (-x[0], x[1])
        )
        top = ", ".join(f"{n}× {reason}" for n, reason in common[:5])
        raise RejectFractionError(
            f"{rejected} of {listed} listed objects under {where} were rejected "
            f"({rejected / listed:.1%} > max_reject_fraction={max_reject_fraction:g}): {top}. "
            "See the reasons above, or raise --max-reject-fraction."
        )
    labels = encode_labels(ok_labels)
    if not labels:
        raise ManifestError(f"no usable images under {where}")
    if twins := case_twins(labels):
        log.warning(
            "labels that differ only by case or spaces are different classes: %s; if they are one "
            "class, fix %s",
            "; ".join(", ".join(map(repr, g)) for g in twins),
            f"the labels of {label_source}" if label_source else "the folder names (the path labels)",
        )
    if len(labels) < min_classes:
        raise ManifestError(
            f"a classifier needs at least 2 classes, but {where} has usable images in 1 class only: "
            f"{next(iter(labels))!r}. "
            + (
                f"Check the labels of {label_source}."
                if label_source
                else "Lay the lake out as <prefix>/<label>/.../<file> with a folder per class (or check --label-depth)."
            )
        )
    return labels


def build_manifest(
    rows: Sequence[StagedRow],
    *,
    split: Mapping[str, float],
    seed: int,
    split_method: str = "hash",
    min_per_class: int = 1,
    max_reject_fraction: float = 1.0,
    source: str = "",
    dedupe: bool = False,
) -> Manifest:
    """Label, split and check ``rows`` (from :func:`jobs.manifest_steps.listing.inspect_objects`).

    With ``dedupe``, of the objects with identical content only the first by key is kept, the
    others are rejected naming it (those rejects do not count against ``max_reject_fraction``:
    they were asked for), so no content is in two channels.

    Raises :class:`SplitError` naming every class below ``min_per_class`` in some channel,
    :class:`RejectFractionError` when too much of the lake was rejected, and
    :class:`ManifestError` when fewer than two classes are left.
    """
    rows = sorted((r.copy() for r in rows), key=lambda r: r["key"])
    where = source or "the input"
    if not rows:
        raise ManifestError(f"no objects found under {where}")
    removed = dedupe_rows([r for r in rows if r["status"] == "ok"]) if dedupe else 0
    ok = [r for r in rows if r["status"] == "ok"]
    reasons = Counter(reason_kind(r["reason"]) for r in rows if r["status"] != "ok")
    labels = check_accepted(
        listed=len(rows),
        reasons=reasons,
        removed=removed,
        ok_labels=[r["label"] for r in ok],
        max_reject_fraction=max_reject_fraction,
        where=where,
    )
    assign = split_function(split_method)
    channels = assign([r["key"] for r in ok], [r["label"] for r in ok], split, seed)
    for r, channel in zip(ok, channels):
        r["channel"] = channel
        r["label_index"] = labels[r["label"]]

    counts = {c: {label: 0 for label in labels} for c in split}
    for r in ok:
        counts[r["channel"]][r["label"]] += 1
    check_min_per_class(counts, list(labels), min_per_class, split_method)

    table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)
    accepted = pa.Table.from_pylist(ok, schema=MANIFEST_SCHEMA)
    by_channel = {c: accepted.filter(pc.equal(accepted["channel"], c)) for c in split}
    rejects = table.filter(pc.equal(table["status"], "rejected"))
    return Manifest(
        all=table,
        channels=by_channel,
        rejects=rejects,
        labels=labels,
        counts=counts,
        duplicates=_duplicates(ok, removed),
    )


def fingerprint(table: pa.Table) -> str:
    """A content hash of the accepted rows (key, what identifies the object's content, label,
    channel: :func:`fingerprint_line`): the manifest's identity, from which the dataset version
    is derived. Each class's rows are hashed in key order and the classes' hashes combined
    (:func:`combine_fingerprints`), so workers that each hold whole classes compute it without
    gathering the rows."""
    hashes: dict[str, Any] = defaultdict(hashlib.sha256)
    columns = ["key", "etag", "size", "last_modified", "label", "channel", "status"]
    for r in table.select(columns).sort_by("key").to_pylist():
        if r["status"] == "ok":
            hashes[r["label"]].update(fingerprint_line(r))
    return combine_fingerprints({label: h.hexdigest() for label, h in hashes.items()})


def combine_fingerprints(by_label: Mapping[str, str]) -> str:
    """The manifest's fingerprint from its classes' (each a SHA-256 of the class's accepted
    rows in key order, :func:`fingerprint_line`): independent of how the rows were parted."""
    h = hashlib.sha256()
    for label in sorted(by_label):
        h.update(f"{label}\x1f{by_label[label]}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def content_id(row: Mapping[str, Any]) -> str:
    """What identifies an object's content in the manifest: its ETag (S3's, or for a local file
    the MD5 of its bytes, which the listing computes as it sniffs), or where there is none (a
    local file listed with ``--no-sniff``) its size and modification time in microseconds: a
    replaced file changes the manifest's fingerprint, hence the dataset version, unless it has the
    same size and kept the old modification time (``docs/jobs.md``, ``--no-sniff``)."""
    if row["etag"]:
        return row["etag"]
    modified = row["last_modified"]
    stamp = "" if modified is None else str((modified - _EPOCH) // dt.timedelta(microseconds=1))
    return f"size={row['size']};mtime_us={stamp}"


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def fingerprint_line(
    row: Mapping[str, Any], channel: str | None = None, columns: Sequence[str] = ()
) -> bytes:
    """What :func:`fingerprint` hashes of one accepted row (``channel``: the row's, unless given):
    its key, :func:`content_id`, label and channel, then the values of ``columns`` (the label
    columns beyond one class and the kept columns, as JSON) if there are any."""
    fields = [row["key"], content_id(row), row["label"] or "", channel or row["channel"]]
    if columns:
        fields.append(json.dumps({c: row.get(c) for c in columns}, sort_keys=True, default=str))
    return "\x1f".join(fields).encode("utf-8", "surrogatepass") + b"\n"
