"""The ``--labels`` table: each object's label (and, optionally, its channel) from a side table.

A CSV (with a header), Parquet or JSON Lines file, or a folder of such files (each read by one
task), chosen by the file name's ending (``.csv``, ``.parquet``/``.pq``,
``.jsonl``/``.ndjson``/``.json``). Columns:

- ``key`` (the object's key relative to ``--input``) or ``uri`` (its full URI); ``key`` wins
  if both are present;
- ``label``: the class name, never empty;
- ``channel`` (optional): a channel of ``--split`` that pins the object there; empty or
  missing: the split rules choose.

With ``--task multi-label`` a row's classes are a ``labels`` list, or its ``label`` (a key's
rows together give its set); with ``--task boxes`` a ``boxes`` list of ``{label, x, y, width,
height}`` (:mod:`jobs.manifest_steps.table_values`: a bad list or box is a reason to reject
its object, not an error of the table). ``--keep-columns`` names further columns, kept with
their Arrow types (a CSV's as PyArrow infers them, a JSON Lines file's from its values).

Every value becomes text the same way whatever the format (:func:`value_text`): text as it is,
an integer as its digits, a number with no fraction as an integer (``0.0`` in JSON or Parquet
is the class ``"0"``, as ``0`` is), another number as Python writes it; a list, an object or a
boolean is refused, naming the row. Surrounding white space is not part of a label or channel
(``"cat "`` is ``"cat"``); a CSV cell is text, taken as written.

:func:`read_labels` reads and checks one file (every value; a bad one is a
:class:`~lakeshard.errors.ManifestError` naming the URI, the column, the row and the value);
:func:`check_labels` runs it on every file before an engine starts, and the workers run it
again when they stage the rows (:mod:`jobs.manifest_steps.label_tasks`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from jobs.manifest_steps.json_lines import JsonLineError, json_lines
from jobs.manifest_steps.table_values import (
    LIST_COLUMNS,
    SINGLE_CLASS,
    TableColumns,
    task_columns,
    value_text,
)
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError

__all__ = [
    "LABEL_COLUMNS",
    "TableColumns",
    "check_labels",
    "kept_schema",
    "label_files",
    "read_labels",
    "value_text",
]

#: The columns read (the first of ``key``/``uri`` present names the object).
LABEL_COLUMNS = ("key", "uri", "label", "channel")
_FORMATS = {
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
}
#: What a row of a JSON Lines table looks like (named in the errors about a table's shape).
_JSONL_ROW = '{"key": "a.png", "label": "cat"}'
#: What a value that is not one class is told (after what it is).
_ONE_CLASS = "a row names one object and one class, each as text or a number"
#: Separators a CSV header written with another one shows (its one column's name holds them).
_SEPARATORS = {";": "';'", "\t": "a tab", "|": "'|'"}


def _format(uri: str) -> str | None:
    name = uri.rsplit("/", 1)[-1].lower()
    return next((fmt for ext, fmt in _FORMATS.items() if name.endswith(ext)), None)


def label_files(uri: str) -> list[str]:
    """The files of the table at ``uri``: the file itself, or the table files in the folder
    (recursively, sorted). Raises :class:`ManifestError` if there are none."""
    uri = storage.normalize(uri)
    fs, path = storage.filesystem(uri)
    try:
        if fs.isfile(path):
            files = [uri]
        elif fs.isdir(path):
            found = (p for p in fs.find(path) if _format(p) and "/." not in p[len(path) :])
            files = sorted(storage.from_listing(uri, p) for p in found)
            if not files:
                raise ManifestError(f"--labels {uri} is a folder holding no .csv, .parquet or .jsonl file")
        else:
            raise ManifestError(f"--labels {uri} does not exist")
    except ManifestError:
        raise
    except Exception as exc:
        raise StorageError(f"cannot read --labels {uri}: {type(exc).__name__}: {exc}") from exc
    if unknown := [f for f in files if _format(f) is None]:
        raise ManifestError(f"--labels {unknown[0]}: unknown table format; name it .csv, .parquet or .jsonl")
    return files


def _document(uri: str, text: str) -> str | None:
    """What a ``.json`` file that is one JSON document (an array, or an object mapping keys to
    labels) holds, as an error saying that JSON Lines is expected; None if it is not one."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if isinstance(doc, list):
        found = f"a JSON array (of {len(doc)} item{'' if len(doc) == 1 else 's'})"
    elif isinstance(doc, dict):
        names = ", ".join(map(repr, list(doc)[:3])) + (", ..." if len(doc) > 3 else "")
        found = f"one JSON object of {len(doc)} member{'' if len(doc) == 1 else 's'} ({names})"
    else:
        return None
    return (
        f"--labels {uri} holds {found}, not JSON Lines: the table is expected as JSON Lines, one JSON "
        f"object a line, such as {_JSONL_ROW} (jq -c '.[]' turns an array of such objects into it)"
    )


def _jsonl(uri: str, data: bytes, keep: Sequence[str] = ()) -> pa.Table:
    text = data.decode("utf-8")
    columns: dict[str, list[Any]] = {c: [] for c in (*LABEL_COLUMNS, *LIST_COLUMNS, *keep)}
    seen: set[str] = set()
    try:
        for n, record in json_lines(enumerate(text.splitlines(), 1)):
            seen.update(record)
            for c in LABEL_COLUMNS:
                try:
                    columns[c].append(value_text(record.get(c)))
                except ValueError as exc:
                    raise ManifestError(f"--labels {uri}: line {n}: {c!r} is {exc}; {_ONE_CLASS}") from None
            for c in LIST_COLUMNS:  # as JSON text, a CSV cell's form: checked per row, later
                columns[c].append(None if record.get(c) is None else json.dumps(record[c]))
            for c in keep:
                columns[c].append(record.get(c))
    except JsonLineError as exc:
        what = (
            f"is not JSON: {exc.cause}"
            if exc.cause is not None
            else f"is not a JSON object: {exc.line[:80]!r}"
        )
        raise ManifestError(_document(uri, text) or f"--labels {uri}: line {exc.at} {what}") from None
    if seen and not seen & {"key", "uri", "label"}:
        names = sorted(seen)
        raise ManifestError(
            _document(uri, text)
            or (
                f"--labels {uri}: no line has a 'key', 'uri' or 'label' member (their members: "
                f"{names[:5]}{' ...' if len(names) > 5 else ''}); JSON Lines rows look like {_JSONL_ROW}"
            )
        )
    texts = {c: pa.array(v, pa.string()) for c, v in columns.items() if c in seen and c not in keep}
    return pa.table({**texts, **{c: _kept_array(uri, c, columns[c]) for c in keep if c in seen}})


def _kept_array(uri: str, name: str, values: list[Any]) -> pa.Array:
    """A ``--keep-columns`` column of a JSON Lines file, typed from its values."""
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise ManifestError(
            f"--labels {uri}: --keep-columns column {name!r} has values of no one type: {exc}"
        ) from None


def _parse(uri: str, data: bytes, keep: Sequence[str] = ()) -> pa.Table:
    fmt = _format(uri)
    try:
        if fmt == "csv":
            types = {c: pa.string() for c in (*LABEL_COLUMNS, *LIST_COLUMNS)}
            return pacsv.read_csv(
                io.BytesIO(data),
                convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=False),
            )
        if fmt == "parquet":
            return pq.read_table(io.BytesIO(data))
        return _jsonl(uri, data, keep)
    except ManifestError:
        raise
    except Exception as exc:
        raise ManifestError(
            f"--labels {uri} is not a readable {fmt} table: {type(exc).__name__}: {exc}"
        ) from None


def _first(mask: pa.ChunkedArray) -> int | None:
    """The index of the first true value of ``mask`` (nulls: false), or None."""
    i = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if i < 0 else i


def _column(uri: str, table: pa.Table, name: str) -> pa.ChunkedArray:
    """Column ``name`` as text: a text column as it is, any other through :func:`value_text`."""
    column = table[name]
    kind = column.type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind):
        return pc.cast(column, pa.string())
    values = []
    for row, value in enumerate(column.to_pylist(), 1):
        try:
            values.append(value_text(value))
        except ValueError as exc:
            raise ManifestError(f"--labels {uri}: row {row}: {name!r} is {exc}; {_ONE_CLASS}") from None
    return pa.chunked_array([pa.array(values, pa.string())])


def _missing_columns(uri: str, names: list[str], missing: str) -> str:
    if len(names) == 1 and (seps := [label for sep, label in _SEPARATORS.items() if sep in names[0]]):
        return (
            f"--labels {uri}: its header {names[0]!r} is separated by {seps[0]}, not by commas: the "
            "table is expected as a comma-separated file (CSV) with a header naming 'key' (or 'uri'), "
            "'label' and optionally 'channel'"
        )
    hint = (
        "; a 'labels' or 'boxes' column is read with --task multi-label or --task boxes"
        if missing == "'label' column" and {"labels", "boxes"} & set(names)
        else ""
    )
    return (
        f"--labels {uri} has no {missing} (its columns: {names}); a 'key' (or 'uri') and a 'label' "
        f"column are needed{hint}"
    )


def _needed(uri: str, names: list[str], columns: TableColumns) -> str:
    """The column naming the object (``key`` or ``uri``), once the columns ``columns`` needs
    are there; else :class:`ManifestError` naming the first missing."""
    where = next((c for c in ("key", "uri") if c in names), None)
    classes = SINGLE_CLASS[columns.task]
    if where is None or not set(classes) & set(names):
        missing = (
            "'key' or 'uri' column" if where is None else " or ".join(f"{c!r}" for c in classes) + " column"
        )
        raise ManifestError(_missing_columns(uri, names, missing))
    if absent := [c for c in columns.keep if c not in names]:
        raise ManifestError(
            f"--labels {uri} has no column {absent[0]!r} named by --keep-columns (its columns: {names})"
        )
    return where


def _labels_column(uri: str, table: pa.Table, columns: TableColumns) -> pa.ChunkedArray:
    """The ``label`` column as text; empty labels refused where it is the one class column."""
    if "label" not in table.column_names or columns.task == "boxes":
        return pa.chunked_array([pa.nulls(table.num_rows, pa.string())])
    label = pc.utf8_trim_whitespace(_column(uri, table, "label"))
    if "labels" in table.column_names and columns.task != "single-label":
        return pc.if_else(pc.equal(label, ""), None, label)  # the row's class may be its list
    return label


def read_labels(uri: str, *, channels: Sequence[str], columns: TableColumns | None = None) -> pa.Table:
    """One file of the table, checked: columns ``key`` or ``uri`` (whichever it has; ``key``
    first), ``label`` and ``channel`` (None: unpinned), all text (:func:`value_text`; the label
    and channel without surrounding white space); with a ``columns.task`` other than
    ``single-label`` the columns of :func:`~jobs.manifest_steps.table_values.task_columns`
    (``labels``, ``boxes``, ``problem``: why the row's object is rejected); then the kept columns.

    Raises :class:`ManifestError` naming ``uri`` and the column, row (1 = the first data row)
    and value of the first bad value: a missing column, an empty key, uri or label, a channel
    not among ``channels``.
    """
    columns = columns or TableColumns()
    try:
        data = storage.cat(storage.normalize(uri))
    except FileNotFoundError:
        raise ManifestError(f"--labels {uri} does not exist") from None
    except Exception as exc:
        raise StorageError(f"cannot read --labels {uri}: {type(exc).__name__}: {exc}") from exc
    table = _parse(uri, data, columns.keep)
    names = table.column_names
    where = _needed(uri, names, columns)
    out = {where: _column(uri, table, where), "label": _labels_column(uri, table, columns)}
    checked = (where, "label") if columns.task == "single-label" or "labels" not in names else (where,)
    for name in checked if columns.task != "boxes" else (where,):
        empty = pc.or_kleene(pc.is_null(out[name]), pc.equal(pc.utf8_trim_whitespace(out[name]), ""))
        if (row := _first(empty)) is not None:
            raise ManifestError(
                f"--labels {uri}: row {row + 1} has an empty {name!r} (every object needs a "
                f"{'label' if name == 'label' else 'key'})"
            )
    channel = _column(uri, table, "channel") if "channel" in names else pa.nulls(table.num_rows, pa.string())
    channel = pc.utf8_trim_whitespace(channel)
    channel = pc.if_else(pc.equal(channel, ""), None, channel)
    unknown = pc.and_(
        pc.is_valid(channel), pc.invert(pc.is_in(channel, value_set=pa.array(list(channels), pa.string())))
    )
    if (row := _first(unknown)) is not None:
        raise ManifestError(
            f"--labels {uri}: row {row + 1} has channel {channel[row].as_py()!r}, which is not a "
            f"channel of --split ({', '.join(channels)})"
        )
    extra = task_columns(table, out["label"], columns)
    kept = {c: table[c] for c in columns.keep}
    return pa.table({where: out[where], "label": out["label"], "channel": channel, **extra, **kept})


def check_labels(uri: str, *, channels: Sequence[str], columns: TableColumns | None = None) -> int:
    """Read and check every file of the ``--labels`` table (before an engine starts); return
    its number of rows. Raises :class:`ManifestError` if a file is bad, the table is empty, or
    a kept column's type differs between its files."""
    rows, kept = 0, None
    for f in label_files(uri):
        table = read_labels(f, channels=channels, columns=columns)
        rows += table.num_rows
        schema = kept_schema(table, columns)
        if kept is not None and not schema.equals(kept):
            raise ManifestError(
                f"--labels {f}: its --keep-columns types ({_types(schema)}) are not those of the files "
                f"before it ({_types(kept)}); give each column one type in every file"
            )
        kept = schema
    if not rows:
        raise ManifestError(f"--labels {storage.normalize(uri)} has no rows")
    return rows


def kept_schema(table: pa.Table, columns: TableColumns | None) -> pa.Schema:
    """The kept columns of a table :func:`read_labels` read, as the manifest will have them."""
    return pa.schema([table.schema.field(c) for c in (columns or TableColumns()).keep])


def _types(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)
