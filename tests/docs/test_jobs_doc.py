"""docs/jobs.md lists every option of both jobs, and nothing else, with the right defaults.

The option tables are checked against the config dataclasses (``jobs.shard_steps.config``), which are the
single source of truth for the command line (``lakeshard.settings.add_arguments``) and the YAML
files. An option added to a dataclass fails this test until its row is added to docs/jobs.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.settings import add_arguments

DOC = Path(__file__).resolve().parents[2] / "docs" / "jobs.md"

# The section of docs/jobs.md that holds each job's option table.
JOBS = {"Manifest job options": ManifestConfig, "Shard job options": ShardConfig}

_ROW = re.compile(r"^\|(.*)\|\s*$")
_FLAG = re.compile(r"`(--[a-z0-9-]+)`")


def _doc_rows(section: str) -> dict[str, tuple[str, str, str]]:
    """``{flag: (flag cell, default cell, meaning cell)}`` of the option table under the
    ``## <section>`` heading of docs/jobs.md."""
    text = DOC.read_text(encoding="utf-8")
    parts = re.split(r"^## (.+?)\s*$", text, flags=re.MULTILINE)
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    if section not in sections:
        raise AssertionError(f"docs/jobs.md has no '## {section}' section (sections: {sorted(sections)})")
    rows: dict[str, tuple[str, str, str]] = {}
    for line in sections[section].splitlines():
        m = _ROW.match(line.strip())
        if not m:
            continue
        cells = [c.strip() for c in m.group(1).split("|")]
        if len(cells) != 3 or set(cells[0]) <= set("-: "):
            continue  # the separator row, or a table that is not an option table
        flag = _FLAG.search(cells[0])
        if flag is None:
            if cells[0].lower() == "option":
                continue  # the header row
            raise AssertionError(
                f"docs/jobs.md, {section}: row {line.strip()!r} names no `--flag` in its first cell"
            )
        if flag.group(1) in rows:
            raise AssertionError(f"docs/jobs.md, {section}: {flag.group(1)} has two rows")
        rows[flag.group(1)] = (cells[0], cells[1], cells[2])
    return rows


def _options(cls: type) -> dict[str, argparse.Action]:
    """``{flag: argparse action}`` of every option ``cls`` puts on the command line."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return {a.option_strings[0]: a for a in parser._actions if a.dest not in ("help", "conf")}


def _expected_default(cls: type, action: argparse.Action) -> str | None:
    """What the default column must say: what ``--help`` shows for it (``add_arguments`` ends
    the field's help text with `` (required)`` or `` (default: ...)``), or None for an option
    whose default is decided at run time, which the doc explains in words."""
    field_help = {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}[action.dest]
    added = action.help[len(field_help) :] if action.help.startswith(field_help) else action.help
    if added.strip() == "(required)":
        return "required"
    shown = re.fullmatch(r" \(default: (.*)\)", added)
    return shown.group(1) if shown else None


def _plain(cell: str) -> str:
    return cell.replace("`", "").strip()


@pytest.mark.parametrize("section", sorted(JOBS))
def test_every_option_has_one_row_and_every_row_is_an_option(section: str) -> None:
    cls = JOBS[section]
    in_code = set(_options(cls))
    in_doc = set(_doc_rows(section))
    assert not in_code - in_doc, (
        f"options of {cls.__name__} missing from docs/jobs.md ({section}): {sorted(in_code - in_doc)}"
    )
    assert not in_doc - in_code, (
        f"docs/jobs.md ({section}) documents options {cls.__name__} does not have: {sorted(in_doc - in_code)}"
    )


@pytest.mark.parametrize("section", sorted(JOBS))
def test_documented_defaults_are_the_dataclass_defaults(section: str) -> None:
    cls = JOBS[section]
    rows = _doc_rows(section)
    wrong = []
    for flag, action in _options(cls).items():
        if flag not in rows:
            continue  # reported by the test above
        want = _expected_default(cls, action)
        got = _plain(rows[flag][1])
        if want is None:
            if not got:
                wrong.append(f"{flag}: empty default cell (say what it defaults to)")
        elif got != want:
            wrong.append(f"{flag}: docs say {got!r}, the dataclass says {want!r}")
    assert not wrong, "docs/jobs.md defaults disagree with " + cls.__name__ + ":\n" + "\n".join(wrong)


@pytest.mark.parametrize("section", sorted(JOBS))
def test_every_choice_is_documented(section: str) -> None:
    cls = JOBS[section]
    rows = _doc_rows(section)
    missing = []
    for flag, action in _options(cls).items():
        if flag in rows and action.choices:
            text = rows[flag][2] + " " + rows[flag][1]
            missing += [f"{flag} {c}" for c in action.choices if f"`{c}`" not in text]
    assert not missing, f"docs/jobs.md ({section}) does not mention these choices (in backticks): {missing}"


def test_boolean_rows_name_both_spellings() -> None:
    """``--overwrite`` also has ``--no-overwrite``; the doc's flag cell shows both."""
    missing = []
    for section, cls in JOBS.items():
        rows = _doc_rows(section)
        for flag, action in _options(cls).items():
            if flag in rows and isinstance(action, argparse.BooleanOptionalAction):
                negative = "--no-" + flag[2:]
                if f"`{negative}`" not in rows[flag][0]:
                    missing.append(f"{section}: {negative}")
    assert not missing, f"docs/jobs.md misses the negative spelling of: {missing}"
