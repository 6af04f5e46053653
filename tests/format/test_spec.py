"""``docs/format.md`` and the code name the same columns (with their types), footer keys and
``dataset.json`` fields (with their types): a field added to one and not the other fails here."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path

import pyarrow as pa
import pytest

from lakeshard.format import FOOTER_KEYS, MANIFEST_SCHEMA, SHARD_REJECTS_SCHEMA, SHARD_SCHEMA
from lakeshard.format.info import DatasetInfo, info_fields

SPEC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def spec_table(title: str) -> list[list[str]]:
    """The rows (cells, the first without its backticks) of the table under ``## <title>``."""
    text = SPEC.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/format.md has no section '## {title}'"
    rows = []
    for line in match.group(1).splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.fullmatch(r"`([^`]+)`", cells[0])
        if name:  # the header row has no backticks
            rows.append([name.group(1), *cells[1:]])
    assert rows, f"the table under '## {title}' is empty"
    return rows


@pytest.mark.parametrize(
    "title, schema",
    [
        ("Shard columns", SHARD_SCHEMA),
        ("Manifest columns", MANIFEST_SCHEMA),
        ("Shard rejects columns", SHARD_REJECTS_SCHEMA),
    ],
)
def test_columns_and_types_match_the_schemas(title: str, schema: pa.Schema):
    assert [(r[0], r[1]) for r in spec_table(title)] == [(f.name, str(f.type)) for f in schema]


def test_footer_keys_match():
    assert [r[0] for r in spec_table("Footer keys")] == list(FOOTER_KEYS)


def _doc_type(hint: typing.Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_doc_type(inner)} or null"
    if dataclasses.is_dataclass(hint) or origin is dict:
        return "object"
    if origin is list:
        return "list" if dataclasses.is_dataclass(args[0]) else f"list of {_doc_type(args[0])}"
    return {int: "int", str: "string", float: "number", bool: "bool"}[hint]


def test_dataset_json_fields_and_types_match_the_model():
    documented = {r[0]: r[1] for r in spec_table("dataset.json fields")}
    modelled = {path: _doc_type(hint) for path, hint in info_fields().items()}
    assert sorted(set(documented) - set(modelled)) == [], "documented but not in DatasetInfo"
    assert sorted(set(modelled) - set(documented)) == [], "in DatasetInfo but not documented"
    assert documented == modelled


def _optional_fields(cls: type = DatasetInfo, prefix: str = "") -> set[str]:
    """The paths of the model's fields that have a default (an older writer may leave them out)."""
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, hint = f"{prefix}{f.name}", hints[f.name]
        if f.default is not dataclasses.MISSING:
            out.add(path)
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if dataclasses.is_dataclass(inner[0]):
            out |= _optional_fields(inner[0], f"{path}.")
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
            out |= _optional_fields(typing.get_args(hint)[1], f"{path}.<channel>.")
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            out |= _optional_fields(typing.get_args(hint)[0], f"{path}[].")
    return out


def test_the_optional_fields_are_the_model_fields_with_a_default():
    documented = {r[0] for r in spec_table("dataset.json fields") if r[2].startswith("optional")}
    assert documented == _optional_fields()
    assert documented  # the check above must compare something


def test_the_spec_names_the_current_format_version():
    from lakeshard.format import FORMAT_VERSION

    assert SPEC.read_text().splitlines()[0] == f"# The lakeshard dataset format (version {FORMAT_VERSION})"


def test_the_files_table_names_the_manifest_parts_as_the_layout_writes_them():
    from lakeshard.format import manifest_part_uri, sagemaker_part_uri

    paths = [r[0] for r in spec_table("Files")]
    got = {manifest_part_uri("s3://b/d", t, 1, 4)[len("s3://b/d/") :] for t in ("all", "train", "rejects")}
    got.add(sagemaker_part_uri("s3://b/d", "train", 1, 4)[len("s3://b/d/") :])
    documented = {
        p.replace("<i>", "00001").replace("<n>", "00004").replace("<channel>", "train") for p in paths
    }
    assert got <= documented, sorted(got - documented)


def test_a_dataset_json_without_the_optional_fields_reads_with_their_defaults(tmp_path: Path):
    from lakeshard.errors import DatasetError
    from lakeshard.format.info import BaseRef
    from tests.loaders.loader_builders import write_dataset

    write_dataset(tmp_path / "ds", rows={"train": 4}, num_shards=2)
    data = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    for parent, name in [("build", "reused"), ("build", "base"), ("image", "code")]:
        data[parent].pop(name, None)  # as a writer before them wrote it
    info = DatasetInfo.from_json(data)
    assert (info.build.reused, info.build.base, info.image.code) == (0, None, None)
    data["build"]["base"] = {"root": "s3://b/old", "dataset_version": "0123"}
    assert DatasetInfo.from_json(data).build.base == BaseRef(root="s3://b/old", dataset_version="0123")
    assert DatasetInfo.from_json(data).to_json()["build"]["base"] == data["build"]["base"]
    data["build"]["base"] = {"root": "s3://b/old"}
    with pytest.raises(DatasetError, match=r"^d.json: field build.base.dataset_version is missing$"):
        DatasetInfo.from_json(data, source="d.json")
    data["build"]["base"] = "s3://b/old"
    with pytest.raises(DatasetError, match=r"^d.json: field build.base must be an object, got 's3://b/old'$"):
        DatasetInfo.from_json(data, source="d.json")
