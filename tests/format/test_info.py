"""The format's model of dataset.json, its footer check, its shard opener and its writer."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lakeshard import format as fmt
from lakeshard import storage
from lakeshard.errors import DatasetError
from tests.loaders.loader_builders import shard_path, write_dataset


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_dataset(
        tmp_path / "ds", rows={"train": 8, "validation": 4, "test": 4}, num_shards=2, row_group_rows=3
    )
    return tmp_path / "ds"


def raw(root: Path) -> dict[str, Any]:
    return json.loads((root / "dataset.json").read_text())


def test_to_json_gives_back_what_from_json_read(root: Path):
    data = raw(root)
    info = fmt.DatasetInfo.from_json(data)
    assert info.to_json() == data
    assert info.channels["train"].shards[1].path == "shards/channel=train/part-00001-of-00002.parquet"
    assert info.image.size == 8 and info.labels == {"class0": 0, "class1": 1, "class2": 2}
    assert fmt.read_dataset_info(str(root)) == info


def test_the_model_is_read_by_its_fields_not_by_json_keys(root: Path):
    # One owner of the format: a caller reads info.channels, never info["channels"] (a key
    # misspelt there would only fail when that line runs; an attribute is checked by mypy).
    info = fmt.read_dataset_info(str(root))
    with pytest.raises(TypeError, match="not subscriptable"):
        info["channels"]
    assert not hasattr(info, "get")


def test_fields_it_does_not_know_are_ignored(root: Path):
    data = raw(root)
    data["made_by_a_newer_writer"] = {"x": 1}
    data["channels"]["train"]["shards"][0]["extra"] = 5
    assert fmt.DatasetInfo.from_json(data) == fmt.DatasetInfo.from_json(raw(root))


@pytest.mark.parametrize("version", [1, 2, 5, None, "3"])
def test_another_format_version_is_refused_with_what_to_do(root: Path, version: Any):
    data = raw(root)
    data["format_version"] = version
    (root / "dataset.json").write_text(json.dumps(data))
    with pytest.raises(
        DatasetError,
        match=rf"dataset.json has format_version {version!r}; this code reads format "
        r"version 3 only: rebuild the dataset .*jobs/shard.py --overwrite",
    ):
        fmt.read_dataset_info(str(root))


def test_a_task_and_format_version_4_go_together(root: Path):
    data = raw(root)
    assert fmt.DatasetInfo.from_json(data).task_kind == "single-label"
    data.update(format_version=4, task="boxes", columns={"boxes": "list<...>"})
    info = fmt.DatasetInfo.from_json(data)
    assert (info.task_kind, info.to_json()) == ("boxes", data)
    for version, task in [(4, None), (3, "multi-label")]:
        data = raw(root)
        data.update(format_version=version, task=task)
        with pytest.raises(
            DatasetError, match=rf"has format_version {version} and task {task!r}: a single-label"
        ):
            fmt.DatasetInfo.from_json(data)


def _without(data: dict[str, Any], path: list[Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    node = data
    for step in path[:-1]:
        node = node[step]
    del node[path[-1]]
    return data


@pytest.mark.parametrize(
    "path, field",
    [
        (["dataset_version"], "dataset_version"),
        (["image", "size"], "image.size"),
        (["channels", "train", "shards", 1, "rows"], r"channels.train.shards\[1\].rows"),
        (["counts", "padded"], "counts.padded"),
    ],
)
def test_a_missing_field_is_named_with_the_file(root: Path, path: list[Any], field: str):
    (root / "dataset.json").write_text(json.dumps(_without(raw(root), path)))
    with pytest.raises(DatasetError, match=rf"^file://{root}/dataset.json: field {field} is missing$"):
        fmt.read_dataset_info(str(root))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(num_shards="2"), "field num_shards must be an integer, got '2'"),
        (lambda d: d.update(num_shards=True), "field num_shards must be an integer, got True"),
        (lambda d: d["image"].update(format=None), "field image.format must be a string, got None"),
        (
            lambda d: d["image"].update(size=4),
            r"field image: image size must be an integer in \[8, 8192\], got 4",
        ),
        (
            lambda d: d["channels"]["test"].update(shards={}),
            r"field channels.test.shards must be a list, got \{\}",
        ),
        (
            lambda d: d["inputs"]["split"].update(train="half"),
            "field inputs.split.train must be a number, got 'half'",
        ),
        (lambda d: d.update(labels=[]), r"field labels must be an object, got \[\]"),
    ],
)
def test_a_mistyped_field_is_named_with_its_value(root: Path, change, message: str):
    data = raw(root)
    change(data)
    with pytest.raises(DatasetError, match=f"^where.json: {message}$"):
        fmt.DatasetInfo.from_json(data, source="where.json")


def test_a_missing_channel_is_named(root: Path):
    info = fmt.read_dataset_info(str(root))
    data = raw(root)
    del data["channels"]["test"]
    with pytest.raises(DatasetError, match=r"has no channel 'test' \(it has \['train', 'validation'\]\)"):
        fmt.channel_shards(str(root), fmt.DatasetInfo.from_json(data), "test")
    assert [rows for _, rows in fmt.channel_shards(str(root), info, "test")] == [2, 2]


def test_check_footer_names_the_key_both_values_and_the_shard():
    footer = {"dataset_version": "aaa", "channel": "train", "shard_index": "1"}
    fmt.check_footer("s3://b/x.parquet", footer, {"channel": "train", "shard_index": 1})
    with pytest.raises(
        DatasetError,
        match=r"^shard s3://b/x.parquet footer says lakeshard.dataset_version='aaa', "
        r"expected 'bbb' \(the dataset was rebuilt",
    ):
        fmt.check_footer("s3://b/x.parquet", footer, {"dataset_version": "bbb"})
    with pytest.raises(DatasetError, match=r"footer says lakeshard.num_shards=None, expected '2'"):
        fmt.check_footer("s3://b/x.parquet", footer, {"num_shards": 2})


def test_a_footer_key_outside_the_spec_is_refused():
    with pytest.raises(ValueError, match=r"footer keys \['colour'\] are not in FOOTER_KEYS"):
        fmt.footer_metadata({"channel": "train", "colour": "red"})


def test_the_opener_checks_a_shard_against_dataset_json(root: Path):
    info = fmt.read_dataset_info(str(root))
    uri = fmt.shard_uri(storage.normalize(str(root)), "train", 1, 2)
    with fmt.open_shard(uri) as shard:
        assert shard.footer == {
            "dataset_version": info.dataset_version,
            "channel": "train",
            "shard_index": "1",
            "num_shards": "2",
            "format_version": "3",
            "image_format": "png",
            "image_size": "8",
        }
        assert shard.check(info, "train", 1, rows=4) == [3, 1]  # row_group_rows=3
        with pytest.raises(DatasetError, match=r"footer says lakeshard.shard_index='1', expected '0'"):
            shard.check(info, "train", 0)
        with pytest.raises(DatasetError, match=r"has 4 rows, dataset.json says 5"):
            shard.check(info, "train", 1, rows=5)
    shard_path(root, "train", 1, 2).write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=rf"^cannot open shard {uri}: "):
        fmt.open_shard(uri)


def test_the_writer_closes_row_groups_by_rows_or_bytes(tmp_path: Path):
    table = pa.table(
        {
            "image": [b"x" * 10] * 7,
            "label": list(range(7)),
            "uri": ["u"] * 7,
            "key": ["k"] * 7,
            "height": pa.array([1] * 7, pa.int32()),
            "width": pa.array([1] * 7, pa.int32()),
            "is_pad": [False] * 7,
        },
        schema=fmt.SHARD_SCHEMA,
    )
    sizes = {}
    for name, options in {
        "rows": {"row_group_bytes": 1000, "row_group_rows": 3},
        "bytes": {"row_group_bytes": 20, "row_group_rows": 3},
        "bytes only": {"row_group_bytes": 40},
    }.items():
        uri = storage.normalize(str(tmp_path / f"{name}.parquet"))
        with fmt.ShardWriter(uri, metadata={"channel": "train"}, **options) as writer:
            writer.write(table.slice(0, 2))
            writer.write(table.slice(2))
        md = pq.ParquetFile(tmp_path / f"{name}.parquet").metadata
        sizes[name] = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        assert writer.stats["row_groups"] == md.num_row_groups
    assert sizes == {"rows": [3, 3, 1], "bytes": [2, 2, 2, 1], "bytes only": [4, 3]}


def test_the_layout_keeps_shards_alone_below_shards():
    assert fmt.shard_relpath("validation", 2, 4) == "shards/channel=validation/part-00002-of-00004.parquet"
    assert (
        fmt.shard_uri("s3://b/ds", "test", 0, 1)
        == "s3://b/ds/shards/channel=test/part-00000-of-00001.parquet"
    )
    assert (
        fmt.shards_folder_uri("s3://b/stage", "train", 0, 1)
        == "s3://b/stage/channel=train/part-00000-of-00001.parquet"
    )
    assert fmt.shard_rejects_uri("s3://b/ds") == "s3://b/ds/rejects/shards.parquet"
    assert not fmt.shard_rejects_uri("s3://b/ds").startswith(fmt.shards_uri("s3://b/ds"))


V = "0123456789abcdef-89abcdef"  # a version folder's name: <dataset_version>-<build hash>


def test_a_shard_path_is_the_local_layout_or_one_version_folder():
    assert fmt.check_shard_path("shards/channel=train/part-00001-of-00002.parquet", "train", 1, 2) is None
    assert fmt.check_shard_path(f"shards/v={V}/channel=train/part-00001-of-00002.parquet", "train", 1, 2) == V
    assert (
        fmt.check_shard_path(f"shards/v={V}/channel=test/part-00000-of-00002.assembled.parquet", "test", 0, 2)
        == V
    )
    assert fmt.versions_uri("s3://b/ds", V) == f"s3://b/ds/shards/v={V}"
    assert fmt.version_marker_uri("s3://b/ds", V) == f"s3://b/ds/shards/v={V}/_version.json"
    for bad in [
        "shards/channel=train/part-00000-of-00002.parquet",  # another index
        "shards/channel=test/part-00001-of-00002.parquet",  # another channel
        "shards/channel=train/part-00001-of-00003.parquet",  # another count
        "shards/v=../channel=train/part-00001-of-00002.parquet",
        f"shards/v={V}/x/channel=train/part-00001-of-00002.parquet",
        f"/shards/v={V}/channel=train/part-00001-of-00002.parquet",
        "s3://elsewhere/shards/channel=train/part-00001-of-00002.parquet",
        "manifests/all.parquet",
    ]:
        with pytest.raises(
            ValueError, match=r"is not shards/\[v=<version>/\]channel=train/part-00001-of-00002"
        ):
            fmt.check_shard_path(bad, "train", 1, 2)
    with pytest.raises(ValueError, match="a shard version must match"):
        fmt.version_dirname("../x")


def _move_to_version(root: Path, data: dict[str, Any], versions: dict[str, str]) -> None:
    """Move each channel's shards into the version folder ``versions[channel]`` and name them there."""
    for channel, entry in data["channels"].items():
        for shard in entry["shards"]:
            new = shard["path"].replace("shards/", f"shards/v={versions[channel]}/", 1)
            (root / new).parent.mkdir(parents=True, exist_ok=True)
            (root / shard["path"]).rename(root / new)
            shard["path"] = new
    (root / "dataset.json").write_text(json.dumps(data))


def test_the_loader_reads_the_shards_where_dataset_json_names_them(root: Path):
    data = raw(root)
    _move_to_version(root, data, {c: V for c in data["channels"]})
    info = fmt.read_dataset_info(str(root))
    base = storage.normalize(str(root))
    shards = fmt.channel_shards(base, info, "train")
    assert shards == [
        (f"{base}/shards/v={V}/channel=train/part-0000{i}-of-00002.parquet", 4) for i in range(2)
    ]
    assert fmt.shard_version(info) == V
    with fmt.open_shard(shards[1][0]) as shard:
        assert shard.check(info, "train", 1, rows=4) == [3, 1]


def test_shards_of_two_version_folders_are_refused(root: Path):
    data = raw(root)
    _move_to_version(root, data, {"train": V, "validation": V, "test": V.replace("0", "1")})
    info = fmt.read_dataset_info(str(root))
    with pytest.raises(DatasetError, match="names shards in several version folders"):
        fmt.channel_shards(storage.normalize(str(root)), info, "train")


def test_a_shard_path_outside_the_layout_is_refused(root: Path):
    data = raw(root)
    data["channels"]["train"]["shards"][1]["path"] = "../elsewhere/part-00001-of-00002.parquet"
    (root / "dataset.json").write_text(json.dumps(data))
    info = fmt.read_dataset_info(str(root))
    with pytest.raises(DatasetError, match=r"dataset.json: train shard 1: shard path '../elsewhere/"):
        fmt.channel_shards(storage.normalize(str(root)), info, "train")


def test_the_rejects_table_is_where_dataset_json_names_it_beside_the_shards(root: Path):
    base = storage.normalize(str(root))
    assert fmt.rejects_uri(base, fmt.read_dataset_info(str(root))) == f"{base}/rejects/shards.parquet"
    data = raw(root)
    _move_to_version(root, data, {c: V for c in data["channels"]})
    with pytest.raises(
        DatasetError,
        match=rf"rejects_path is 'rejects/shards.parquet', expected 'shards/v={V}/_rejects.parquet'",
    ):
        fmt.rejects_uri(base, fmt.read_dataset_info(str(root)))
    data["rejects_path"] = f"shards/v={V}/_rejects.parquet"
    (root / "dataset.json").write_text(json.dumps(data))
    assert fmt.rejects_uri(base, fmt.read_dataset_info(str(root))) == f"{base}/shards/v={V}/_rejects.parquet"
    assert fmt.shard_rejects_uri(base, V) == f"{base}/shards/v={V}/_rejects.parquet"


@pytest.mark.s3
def test_a_remote_footer_is_read_without_a_head(tmp_path: Path, s3_bucket: str, monkeypatch):
    """``read_shard_footer`` on S3: one suffix-range GET (the size and ETag from its answer) for a
    footer that fits in it, a second one for the rest of a longer footer, never a HEAD; the
    footer is the file's own. An object that is not Parquet is a DatasetError naming it."""
    import boto3

    from tests.hardening.faultproxy import FaultProxy

    write_dataset(
        tmp_path / "ds", rows={"train": 8, "validation": 4, "test": 4}, num_shards=1, row_group_rows=3
    )
    small = shard_path(tmp_path / "ds", "train", 0, 1)
    big = tmp_path / "big.parquet"  # a footer of ~400 kB: long key-value metadata
    table = pq.read_table(small)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"filler": b"x" * 400_000}), big)
    client, bucket = boto3.client("s3"), s3_bucket[len("s3://") :]
    for name, path in (("small.parquet", small), ("big.parquet", big)):
        client.put_object(Bucket=bucket, Key=name, Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key="not.parquet", Body=b"PAR1 and then nothing of the sort")
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        requests = {}
        for name, path in (("small.parquet", small), ("big.parquet", big)):
            proxy.reset(mode="pass")
            footer = fmt.read_shard_footer(f"{s3_bucket}/{name}")
            requests[name] = [(r.method, r.byte_range) for r in proxy.log]
            assert footer.metadata.equals(pq.read_metadata(path)) and footer.size == path.stat().st_size
            assert f'"{footer.etag}"' == client.head_object(Bucket=bucket, Key=name)["ETag"]  # unquoted
        assert footer.metadata.metadata[b"filler"] == b"x" * 400_000
        with pytest.raises(
            DatasetError, match=rf"^cannot open shard {s3_bucket}/not.parquet: .*Parquet's magic"
        ):
            fmt.read_shard_footer(f"{s3_bucket}/not.parquet")
    finally:
        proxy.stop()
    info = fmt.read_dataset_info(str(tmp_path / "ds"))
    assert fmt.read_shard_footer(f"{s3_bucket}/small.parquet").check(info, "train", 0, rows=8) == [3, 3, 2]
    size = big.stat().st_size
    footer_start = (
        size - 8 - int.from_bytes(big.read_bytes()[-8:-4], "little")
    )  # Parquet: ...footer, length, PAR1
    assert footer_start < size - 262144
    assert requests == {
        "small.parquet": [("GET", "bytes=-262144")],
        "big.parquet": [("GET", "bytes=-262144"), ("GET", f"bytes={footer_start}-{size - 262144 - 1}")],
    }
