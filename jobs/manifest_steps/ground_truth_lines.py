"""One line of a SageMaker Ground Truth augmented manifest (``--input-manifest``): its object
and its class name (:func:`label_of`; the format is described in
:mod:`jobs.manifest_steps.ground_truth`), or with ``--task multi-label`` or ``boxes`` its
classes or boxes (:func:`set_label_of`), and the driver's check of the first lines before an
engine starts (:func:`check_input_manifest`)."""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

from jobs.manifest_steps.json_lines import JsonLineError, json_lines
from jobs.manifest_steps.table_values import BadValue, parse_boxes, value_text
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError

__all__ = [
    "CHECK_LINES",
    "TASK_LINES",
    "Line",
    "LineLabel",
    "SetLabel",
    "UnsupportedLine",
    "check_input_manifest",
    "key_under",
    "label_of",
    "parse_line",
    "parse_set_line",
    "set_label_of",
]

#: Lines of the manifest checked on the driver before an engine starts.
CHECK_LINES = 1000


class UnsupportedLine(ValueError):
    """A line that is not a single-label classification (the caller names where it is)."""


class LineLabel(NamedTuple):
    """A line's class name, or (``label`` None) the reject reason of a line without the attribute."""

    label: str | None
    reason: str | None


class Line(NamedTuple):
    """One line of the manifest: its object's URI, its class name or its reject reason."""

    uri: str
    label: str | None
    reason: str | None


def label_of(record: dict[str, Any], attribute: str) -> LineLabel:
    """The line's class name, or the reject reason of a line without the attribute.

    Raises ``ValueError`` (with no location: the caller adds it) for a value that is not one
    class: a list (multi-label), an object (bounding boxes, ...), an index with no class name."""
    meta = record.get(f"{attribute}-metadata")
    meta = meta if isinstance(meta, dict) else {}
    value = record.get(attribute)
    if value is None:
        failure = meta.get("failure-reason")
        why = f" (failure-reason: {failure})" if failure else ""
        return LineLabel(None, f"no label: the line has no {attribute!r} in --input-manifest{why}")
    kind = str(meta.get("type", ""))
    if isinstance(value, list) or kind.endswith("multilabel"):
        raise UnsupportedLine(
            f"{attribute!r} is {value!r:.80} ({kind or 'a list'}): multi-label classification is not "
            "supported (each object needs exactly one class)"
        )
    if isinstance(value, (dict, bool)):
        raise UnsupportedLine(
            f"{attribute!r} is {value!r:.80}{f' ({kind})' if kind else ''}: not an image "
            "classification label (one class index or name)"
        )
    try:  # a value and a class name become text as a --labels table's do (0.0 is the class index "0")
        text = value_text(value)
        name = value_text(meta.get("class-name"))
    except ValueError as exc:
        raise UnsupportedLine(f"{attribute!r} or its class-name is {exc}: not one class") from None
    if name is None and isinstance(meta.get("class-map"), dict):
        name = meta["class-map"].get(text)
    if name is None and isinstance(value, str):
        name = value
    if not isinstance(name, str) or not name.strip():
        raise UnsupportedLine(
            f"{attribute!r} is {value!r:.80} but {attribute}-metadata gives no class-name for it "
            f"(got {meta.get('class-name', meta.get('class-map'))!r:.80})"
        )
    return LineLabel(name.strip(), None)


class SetLabel(NamedTuple):
    """A multi-label or bounding-box line's classes (sorted names) and boxes, or why its object
    is rejected (``problem``: a class index not in the ``class-map``, a malformed box)."""

    labels: list[str] | None
    boxes: list[dict[str, Any]] | None
    problem: str | None


#: What a line of each task is, as an error says it is not.
TASK_LINES = {
    "single-label": "a single-label image classification",
    "multi-label": "a multi-label image classification (a list of class indices)",
    "boxes": "a bounding-box label (annotations and image_size)",
}


def _class_name(names: dict[str, Any], value: Any, attribute: str) -> str:
    """The ``class-map`` name of a class index."""
    try:
        text = value_text(value)
    except ValueError as exc:
        raise BadValue(f"bad labels: a class index of {attribute!r} is {exc}") from None
    name = names.get(text or "")
    if not isinstance(name, str) or not name.strip():
        raise BadValue(f"unknown class: class index {text} is not in {attribute}-metadata's class-map")
    return name.strip()


def _boxes(value: dict[str, Any], meta: dict[str, Any], names: dict[str, Any], attribute: str) -> SetLabel:
    """A bounding-box line's boxes (``left``/``top`` are the box's ``x``/``y``; each box's
    ``confidence`` from the metadata's ``objects``, in the same order)."""
    found, objects = value.get("annotations"), meta.get("objects")
    if not isinstance(found, list):
        raise BadValue(f"bad box: {attribute}'s annotations is {found!r:.80}, not a list")
    objects = objects if isinstance(objects, list) and len(objects) == len(found) else [{}] * len(found)
    boxes = []
    for a, o in zip(found, objects):
        if not isinstance(a, dict):
            raise BadValue(f"bad box: an annotation of {attribute!r} is {a!r:.80}, not an object")
        confidence = o.get("confidence") if isinstance(o, dict) else None
        place = {"x": a.get("left"), "y": a.get("top"), "width": a.get("width"), "height": a.get("height")}
        boxes.append(
            {"label": _class_name(names, a.get("class_id"), attribute), **place, "confidence": confidence}
        )
    checked = parse_boxes(boxes, units="pixels")
    return SetLabel(sorted({b["label"] for b in checked}), checked, None)


def set_label_of(record: dict[str, Any], attribute: str, task: str) -> SetLabel | LineLabel:
    """A ``multi-label`` line's classes (its value a list of class indices, named by the
    metadata's ``class-map``) or a ``boxes`` line's boxes (its value ``{image_size,
    annotations: [{class_id, left, top, width, height}]}``); a line without the attribute
    gives its reject reason as :func:`label_of` does.

    Raises :class:`UnsupportedLine` for a line of another task."""
    meta = record.get(f"{attribute}-metadata")
    meta = meta if isinstance(meta, dict) else {}
    value = record.get(attribute)
    if value is None:
        return label_of(record, attribute)
    found = meta.get("class-map")
    names: dict[str, Any] = found if isinstance(found, dict) else {}
    fits = (
        isinstance(value, list)
        if task == "multi-label"
        else isinstance(value, dict) and "annotations" in value
    )
    if not fits:
        kind = meta.get("type")
        raise UnsupportedLine(
            f"{attribute!r} is {value!r:.80}{f' ({kind})' if kind else ''}: not {TASK_LINES[task]}"
        )
    try:
        if task == "boxes":
            return _boxes(value, meta, names, attribute)
        labels = sorted({_class_name(names, v, attribute) for v in value})
        if not labels:
            raise BadValue(f"bad labels: {attribute!r} is an empty list (an image needs at least one class)")
        return SetLabel(labels, None, None)
    except BadValue as exc:
        return SetLabel(None, None, str(exc))


def _source(record: dict[str, Any]) -> str:
    """A line's object: its ``source-ref`` URI, normalised."""
    ref = record.get("source-ref")
    if not isinstance(ref, str) or not storage.is_uri(ref):
        raise UnsupportedLine(f"source-ref is {ref!r:.120}, not an s3:// (or file://) URI")
    try:
        return storage.normalize(ref)
    except StorageError as exc:
        raise UnsupportedLine(f"source-ref {ref!r}: {exc}") from None


def parse_line(record: dict[str, Any], attribute: str) -> Line:
    """One line's object and class name (or reject reason)."""
    return Line(_source(record), *label_of(record, attribute))


def parse_set_line(record: dict[str, Any], attribute: str, task: str) -> tuple[str, SetLabel | LineLabel]:
    """One ``multi-label`` or ``boxes`` line's object and :func:`set_label_of`."""
    return _source(record), set_label_of(record, attribute, task)


def key_under(uri: str, root: str) -> str | None:
    """``uri``'s key relative to ``root``, or None if it is not under ``root``."""
    under = root.rstrip("/") + "/"
    return uri[len(under) :] if uri.startswith(under) else None


def check_input_manifest(uri: str, *, attribute: str, root: str, task: str = "single-label") -> int:
    """Check the first :data:`CHECK_LINES` lines of the manifest at ``uri`` (before an engine
    starts); return how many were read. Raises :class:`ManifestError` naming the URI, the line
    number and the value: a missing or empty manifest, a line that is not a JSON object with an
    ``s3://`` ``source-ref``, a label that is not one class; none of those lines having
    ``attribute`` (a misspelt ``--label-attribute``), or none being under ``root``."""
    uri, root = storage.normalize(uri), storage.normalize(root)
    fs, path = storage.filesystem(uri)
    seen: set[str] = set()
    under = 0
    try:
        if not fs.isfile(path):
            raise ManifestError(
                f"--input-manifest {uri} does not exist (give the output.manifest file of a "
                "Ground Truth labelling job)"
            )
        with fs.open(path, "rb") as f:
            first = list(itertools.islice(f, CHECK_LINES))
        n = len(first)
        try:
            for line in json_lines(enumerate(first, 1)):
                try:
                    if task == "single-label":
                        ref = parse_line(line.record, attribute).uri
                    else:
                        ref = parse_set_line(line.record, attribute, task)[0]
                except UnsupportedLine as exc:
                    raise ManifestError(f"--input-manifest {uri}: line {line.at}: {exc}") from None
                seen.update(line.record.keys())
                under += key_under(ref, root) is not None
        except JsonLineError as exc:
            raise ManifestError(f"--input-manifest {uri}: line {exc.at}: {exc}") from None
    except (ManifestError, StorageError):
        raise
    except Exception as exc:
        raise StorageError(f"cannot read --input-manifest {uri}: {type(exc).__name__}: {exc}") from exc
    if not seen:
        raise ManifestError(f"--input-manifest {uri} has no lines")
    if attribute not in seen and f"{attribute}-metadata" not in seen:
        names = sorted(k for k in seen if k != "source-ref" and not k.endswith("-metadata"))
        raise ManifestError(
            f"--label-attribute {attribute!r}: none of the first {n} line(s) of --input-manifest {uri} "
            f"has it (their label attributes: {names})"
        )
    if not under:
        raise ManifestError(
            f"--input-manifest {uri}: none of the first {n} line(s) names an object under --input "
            f"{root} (give as --input the prefix every source-ref is under)"
        )
    return n
