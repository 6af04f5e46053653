"""The columns the loader reads, converted from Arrow's buffers.

Arrow's ``to_numpy`` and ``fill_null`` import pandas on first use (0.4 s), and ``cast`` imports
``pyarrow.compute`` (~0.1 s): on the reader thread, before a fresh process's first batch, with
the decode threads idle. The columns the loader reads are converted from their buffers instead
(a cast only for types the format does not use).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from loaders._internal.extensions import extension, fall_back

__all__ = ["binary_rows", "int64_column"]

_rows = extension("_rows", "images are copied out of Arrow with to_pylist(), which holds the GIL (slower)")


def _bits(buffer: pa.Buffer, array: pa.Array) -> np.ndarray:
    """``array``'s bits (0 or 1, uint8) of a bit-packed ``buffer``: its validity or boolean values."""
    bits = np.unpackbits(np.frombuffer(buffer, dtype=np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)]


def _validity(array: pa.Array) -> np.ndarray:
    """True where ``array`` is not null."""
    bitmap = array.buffers()[0]
    return np.ones(len(array), dtype=bool) if bitmap is None else _bits(bitmap, array).astype(bool)


def int64_column(column: pa.ChunkedArray, *, null: int) -> np.ndarray:
    """An integer or boolean column as int64, ``null`` where it is null (without nulls, a
    read-only view of Arrow's buffer: the window's concatenation copies it)."""
    array = column.combine_chunks()
    if pa.types.is_boolean(array.type):
        values = _bits(array.buffers()[1], array).astype(np.int64)
    else:
        if array.type != pa.int64():
            array = array.cast(pa.int64())
        values = np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array), offset=array.offset * 8)
    return np.where(_validity(array), values, null) if array.null_count else values


def binary_rows(column: pa.ChunkedArray) -> list[bytes | None]:
    """``column.to_pylist()`` for the image column, one ``bytes`` (or ``None``) per row.

    ``to_pylist`` holds the GIL while it copies a whole window of images, and the decode threads
    wait for it; ``loaders/_rows.c``, when built, allocates the ``bytes`` with the GIL and copies
    into them without it (``docs/performance.md`` has what that buys)."""
    if _rows is None:
        fall_back("_rows")
        return column.to_pylist()
    rows: list[bytes | None] = []
    for chunk in column.chunks:
        validity, offsets, values = chunk.buffers() if pa.types.is_binary(chunk.type) else (None, None, None)
        if offsets is None or values is None:  # large_binary (not the format's type), or no data
            rows.extend(chunk.to_pylist())
        else:
            rows.extend(_rows.rows(offsets, values, chunk.offset, len(chunk), validity))
    return rows
