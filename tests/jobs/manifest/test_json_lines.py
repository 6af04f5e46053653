"""The one JSON Lines reader (a ``.jsonl`` labels table, a Ground Truth manifest): each line's
object with where it is, blank lines passed by, a bad line named by where it is."""

from __future__ import annotations

import pytest

from jobs.manifest_steps.json_lines import JsonLine, JsonLineError, json_lines


def test_each_object_comes_with_where_its_line_is():
    lines = ['{"key": "a.png"}', "", "  ", b'{"key": "b.png", "label": 0}']
    assert list(json_lines(enumerate(lines, 1))) == [
        JsonLine(1, {"key": "a.png"}),
        JsonLine(4, {"key": "b.png", "label": 0}),
    ]


@pytest.mark.parametrize(
    ("line", "text", "parsed"),
    [
        (
            "{oops",
            "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)): '{oops'",
            False,
        ),
        (b"[1, 2]\n", "not a JSON object: b'[1, 2]\\n'", True),
    ],
)
def test_a_bad_line_is_named_by_where_it_is(line, text, parsed):
    with pytest.raises(JsonLineError) as caught:
        list(json_lines([(120, '{"key": "a.png"}'), (130, line), (140, '{"key": "c.png"}')]))
    error = caught.value
    assert (error.at, error.line, str(error)) == (130, line, text)
    assert (error.cause is None) == parsed


def test_with_on_error_a_bad_line_is_handed_over_and_the_rest_read():
    bad: list[JsonLineError] = []
    lines = [(1, "{nope"), (2, '{"key": "a.png"}'), (3, '"text"'), (4, '{"key": "b.png"}')]
    assert [line.record["key"] for line in json_lines(lines, on_error=bad.append)] == ["a.png", "b.png"]
    assert [e.at for e in bad] == [1, 3]
