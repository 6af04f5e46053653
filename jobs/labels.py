"""The ``--labels`` table: each object's label (and, optionally, its channel) from a side table.

A CSV (with a header), Parquet or JSON Lines file, or a folder of such files (each read by one
task), chosen by the file name's ending (``.csv``, ``.parquet``/``.pq``,
``.jsonl``/``.ndjson``/``.json``). Columns:

- ``key`` (the object's key relative to ``--input``) or ``uri`` (its full URI); ``key`` wins
  if both are present;
- ``label``: the class name, never empty;
- ``channel`` (optional): a channel of ``--split`` that pins the object there; empty or
  missing: the split rules choose.

:func:`read_labels` reads and checks one file (every value; a bad one is a
:class:`~lakeshard.errors.ManifestError` naming the URI, the column, the row and the value);
:func:`check_labels` runs it on every file before an engine starts, and the workers run it
again when they stage the rows (:mod:`jobs.label_tasks`).
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

from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError

__all__ = ["LABEL_COLUMNS", "check_labels", "label_files", "read_labels"]

#: The columns read (the first of ``key``/``uri`` present names the object).
LABEL_COLUMNS = ("key", "uri", "label", "channel")
_FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
            ".json": "jsonl"}


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
            scheme = "s3://" if uri.startswith("s3://") else "file://"
            files = sorted(scheme + p for p in fs.find(path) if _format(p) and "/." not in p[len(path):])
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


def _jsonl(uri: str, data: bytes) -> pa.Table:
    columns: dict[str, list[Any]] = {c: [] for c in LABEL_COLUMNS}
    seen: set[str] = set()
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ManifestError(f"--labels {uri}: line {n} is not JSON: {exc}") from None
        if not isinstance(record, dict):
            raise ManifestError(f"--labels {uri}: line {n} is not a JSON object: {line[:80]!r}")
        seen.update(record)
        for c in LABEL_COLUMNS:
            value = record.get(c)
            columns[c].append(None if value is None else str(value))
    return pa.table({c: pa.array(v, pa.string()) for c, v in columns.items() if c in seen})


def _parse(uri: str, data: bytes) -> pa.Table:
    fmt = _format(uri)
    try:
        if fmt == "csv":
            types = {c: pa.string() for c in LABEL_COLUMNS}
            return pacsv.read_csv(io.BytesIO(data), convert_options=pacsv.ConvertOptions(
                column_types=types, strings_can_be_null=False))
        if fmt == "parquet":
            return pq.read_table(io.BytesIO(data))
        return _jsonl(uri, data)
    except ManifestError:
        raise
    except Exception as exc:
        raise ManifestError(f"--labels {uri} is not a readable {fmt} table: {type(exc).__name__}: {exc}") from None


def _first(mask: pa.ChunkedArray) -> int | None:
    """The index of the first true value of ``mask`` (nulls: false), or None."""
    i = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if i < 0 else i


def _column(uri: str, table: pa.Table, name: str) -> pa.ChunkedArray:
    try:
        return pc.cast(table[name], pa.string())
    except pa.ArrowInvalid as exc:
        raise ManifestError(f"--labels {uri}: column {name!r} is not text ({table.schema.field(name).type}): {exc}") from None


def read_labels(uri: str, *, channels: Sequence[str]) -> pa.Table:
    """One file of the table, checked: columns ``key`` or ``uri`` (whichever it has; ``key``
    first), ``label`` and ``channel`` (None: unpinned), all text.

    Raises :class:`ManifestError` naming ``uri`` and the column, row (1 = the first data row)
    and value of the first bad value: a missing column, an empty key, uri or label, a channel
    not among ``channels``.
    """
    try:
        data = storage.cat(storage.normalize(uri))
    except FileNotFoundError:
        raise ManifestError(f"--labels {uri} does not exist") from None
    except Exception as exc:
        raise StorageError(f"cannot read --labels {uri}: {type(exc).__name__}: {exc}") from exc
    table = _parse(uri, data)
    names = table.column_names
    where = next((c for c in ("key", "uri") if c in names), None)
    if where is None or "label" not in names:
        missing = "'key' or 'uri' column" if where is None else "'label' column"
        raise ManifestError(f"--labels {uri} has no {missing} (its columns: {names})")
    out = {where: _column(uri, table, where), "label": _column(uri, table, "label")}
    for name in (where, "label"):
        empty = pc.or_kleene(pc.is_null(out[name]), pc.equal(pc.utf8_trim_whitespace(out[name]), ""))
        if (row := _first(empty)) is not None:
            raise ManifestError(f"--labels {uri}: row {row + 1} has an empty {name!r} (every object needs a "
                                f"{'label' if name == 'label' else 'key'})")
    channel = _column(uri, table, "channel") if "channel" in names else pa.nulls(table.num_rows, pa.string())
    channel = pc.if_else(pc.equal(channel, ""), None, channel)
    unknown = pc.and_(pc.is_valid(channel), pc.invert(pc.is_in(channel, value_set=pa.array(list(channels), pa.string()))))
    if (row := _first(unknown)) is not None:
        raise ManifestError(f"--labels {uri}: row {row + 1} has channel {channel[row].as_py()!r}, which is not a "
                            f"channel of --split ({', '.join(channels)})")
    return pa.table({where: out[where], "label": out["label"], "channel": channel})


def check_labels(uri: str, *, channels: Sequence[str]) -> int:
    """Read and check every file of the ``--labels`` table (before an engine starts); return
    its number of rows. Raises :class:`ManifestError` if a file is bad or the table is empty."""
    rows = sum(read_labels(f, channels=channels).num_rows for f in label_files(uri))
    if not rows:
        raise ManifestError(f"--labels {storage.normalize(uri)} has no rows")
    return rows
