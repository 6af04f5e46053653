"""JSON Lines: one JSON object a line, as a ``--labels`` table (``.jsonl``) and a SageMaker Ground
Truth manifest (``--input-manifest``) hold them. The one reader of both; each caller says where
the lines come from (a file's lines by number, a byte range's by offset) and words its errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

__all__ = ["JsonLine", "JsonLineError", "json_lines"]


class JsonLine(NamedTuple):
    """One line's JSON object and where the line is (its number, or its byte offset)."""

    at: int
    record: dict[str, Any]


class JsonLineError(ValueError):
    """A line that is not a JSON object: where it is (as :func:`json_lines` was told), the line
    as read (text or bytes), and the JSON parser's error (None: JSON, but not an object). Its
    text says what the line is, not where (the caller names the file and the line)."""

    def __init__(self, at: int, line: str | bytes, cause: ValueError | None) -> None:
        what = f"not JSON ({cause})" if cause is not None else "not a JSON object"
        super().__init__(f"{what}: {line[:80]!r}")
        self.at, self.line, self.cause = at, line, cause


def json_lines(
    lines: Iterable[tuple[int, str | bytes]], *, on_error: Callable[[JsonLineError], None] | None = None
) -> Iterator[JsonLine]:
    """The JSON object of each line of ``lines`` (``(where, line)``: a line number or a byte
    offset, and the line), blank lines passed by.

    Raises :class:`JsonLineError` at the first line that is not a JSON object; with
    ``on_error``, hands it that error instead and goes on with the next line."""
    for at, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            error = JsonLineError(at, line, exc)
        else:
            if isinstance(record, dict):
                yield JsonLine(at, record)
                continue
            error = JsonLineError(at, line, None)
        if on_error is None:
            raise error
        on_error(error)
