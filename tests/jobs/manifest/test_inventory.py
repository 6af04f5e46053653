"""Issue 22: an S3 Inventory report, in S3's own layout on the S3 server, is the lake's listing;
a missing or malformed one fails before any engine starts, naming the URI and what is wrong."""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path
from urllib.parse import quote_plus

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import manifest as manifest_job
from jobs.common.engines.local_engine import LocalEngine
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from lakeshard.errors import ConfigError, ManifestError
from lakeshard.format.manifest_table import read_channel
from tests.helpers.lake import encode, make_image

CSV_SCHEMA = "Bucket, Key, VersionId, IsLatest, IsDeleteMarker, Size, LastModifiedDate, ETag, StorageClass"
PARQUET_SCHEMA = (
    "message s3.inventory { required binary bucket (UTF8); required binary key (UTF8); "
    "optional binary version_id (UTF8); optional boolean is_latest; optional boolean is_delete_marker; "
    "optional int64 size; optional int64 last_modified_date (TIMESTAMP_MILLIS); "
    "optional binary e_tag (UTF8); optional binary storage_class (UTF8);}"
)
DATED = "inv/{bucket}/daily/2026-11-23T01-00Z"


def _upload_lake(bucket: str) -> None:
    client = boto3.client("s3")
    objects = {
        f"raw/{label}/{'sub/' if i % 2 else ''}img {i:03d}.png": encode(make_image(li * 100 + i), "PNG")
        for li, label in enumerate(["cat", "dog"])
        for i in range(12)
    }
    objects |= {
        "raw/dog/ünï +cødé.png": encode(make_image(7), "PNG"),
        "raw/cat/readme.jpg": b"plain text",
        "raw/stray.png": encode(make_image(8), "PNG"),
        "raw/cat/.DS_Store": b"junk",
        "raw/dog/notes.tmp": b"scratch",
        "raw/cat/empty.png": b"",
        "elsewhere/cat/x.png": b"outside --input",
    }
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


def _records(bucket: str) -> list[dict]:
    """What S3 Inventory would report of ``bucket`` (current versions), plus what a versioned
    inventory also holds: a non-current version and a delete marker, and another bucket's row."""
    client = boto3.client("s3")
    objects = client.list_objects_v2(Bucket=bucket)["Contents"]
    records = [
        {
            "bucket": bucket,
            "key": o["Key"],
            "version_id": "v1",
            "is_latest": True,
            "is_delete_marker": False,
            "size": o["Size"],
            "last_modified_date": o["LastModified"],
            "e_tag": o["ETag"].strip('"'),
            "storage_class": "STANDARD",
        }
        for o in objects
    ]
    records += [
        {**records[0], "version_id": "v0", "is_latest": False, "key": "raw/cat/old version.png"},
        {**records[0], "is_delete_marker": True, "size": None, "key": "raw/cat/deleted.png"},
        {**records[0], "bucket": "another-bucket", "key": "raw/cat/theirs.png"},
    ]
    return records


def _csv(records: list[dict]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for r in records:
        modified = (
            r["last_modified_date"].strftime("%Y-%m-%dT%H:%M:%S.")
            + f"{r['last_modified_date'].microsecond // 1000:03d}Z"
        )
        writer.writerow(
            [
                r["bucket"],
                quote_plus(r["key"], safe="/"),
                r["version_id"],
                str(r["is_latest"]).lower(),
                str(r["is_delete_marker"]).lower(),
                "" if r["size"] is None else r["size"],
                modified,
                r["e_tag"],
                r["storage_class"],
            ]
        )
    return gzip.compress(out.getvalue().encode())


def _parquet(records: list[dict]) -> bytes:
    table = pa.Table.from_pylist(
        records,
        schema=pa.schema(
            [
                ("bucket", pa.string()),
                ("key", pa.string()),
                ("version_id", pa.string()),
                ("is_latest", pa.bool_()),
                ("is_delete_marker", pa.bool_()),
                ("size", pa.int64()),
                ("last_modified_date", pa.timestamp("ms", tz="UTC")),
                ("e_tag", pa.string()),
                ("storage_class", pa.string()),
            ]
        ),
    )
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _write_inventory(bucket: str, fmt: str) -> str:
    """An inventory of ``bucket`` in S3's layout (two data files), in the same bucket under
    ``inv/``; return its manifest.json URI."""
    client = boto3.client("s3")
    records = _records(bucket)
    ext, schema, encode_file = (
        ("csv.gz", CSV_SCHEMA, _csv) if fmt == "CSV" else ("parquet", PARQUET_SCHEMA, _parquet)
    )
    files = []
    for n, part in enumerate((records[::2], records[1::2])):
        key = f"inv/{bucket}/daily/data/0f1e2d3c-{n:04d}.{ext}"
        body = encode_file(part)
        client.put_object(Bucket=bucket, Key=key, Body=body)
        files.append({"key": key, "size": len(body), "MD5checksum": "0" * 32})
    manifest = {
        "sourceBucket": bucket,
        "destinationBucket": f"arn:aws:s3:::{bucket}",
        "version": "2016-11-30",
        "creationTimestamp": "1795395600000",
        "fileFormat": fmt,
        "fileSchema": schema,
        "files": files,
    }
    key = f"{DATED.format(bucket=bucket)}/manifest.json"
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    return f"s3://{bucket}/{key}"


def _manifest(bucket: str, out: str, **opts) -> dict:
    cfg = ManifestConfig(
        input=f"s3://{bucket}/raw",
        output=out,
        exclude=("*.tmp",),
        seed=5,
        max_reject_fraction=0.5,
        split={"train": 0.5, "validation": 0.5},
        engine="local",
        **opts,
    )
    check_manifest_inputs(cfg)
    return manifest_job.run(cfg, LocalEngine(workers=2))


@pytest.mark.s3
@pytest.mark.parametrize("fmt", ["CSV", "Parquet"])
def test_an_inventory_gives_the_manifest_a_listing_gives(s3_bucket, fmt, tmp_path):
    bucket = s3_bucket[len("s3://") :]
    _upload_lake(bucket)
    inventory = _write_inventory(bucket, fmt)
    listed = _manifest(bucket, str(tmp_path / "listed"))
    from_inventory = _manifest(bucket, str(tmp_path / "inventory"), inventory=inventory)

    assert from_inventory["counts"] == listed["counts"]
    assert from_inventory["fingerprint"] == listed["fingerprint"]
    assert (
        from_inventory["skipped_by_reason"]
        == listed["skipped_by_reason"]
        == {"excluded: --exclude '*.tmp'": 1, "hidden": 1}
    )
    for name in ("all", "train", "validation", "rejects"):
        a, b = (read_channel(str(tmp_path / d), name) for d in ("listed", "inventory"))
        assert a.to_pylist() == b.to_pylist(), name
    rows = {r["key"]: r for r in read_channel(str(tmp_path / "inventory"), "all").to_pylist()}
    assert rows["dog/ünï +cødé.png"]["status"] == "ok"  # a URL-encoded CSV key, decoded
    assert rows["stray.png"]["reason"].startswith("no label")
    assert not any(
        "version" in k or "deleted" in k or "theirs" in k or k.startswith("elsewhere") for k in rows
    )


@pytest.mark.s3
def test_the_dated_folder_is_enough(s3_bucket, tmp_path):
    bucket = s3_bucket[len("s3://") :]
    _upload_lake(bucket)
    _write_inventory(bucket, "CSV")
    summary = _manifest(bucket, str(tmp_path / "o"), inventory=f"s3://{bucket}/{DATED.format(bucket=bucket)}")
    assert summary["counts"]["listed"] == 28  # 24 images, the ünï one, readme.jpg, stray.png, empty.png


def _local_inventory(tmp_path: Path, manifest: object, data: dict[str, bytes] | None = None) -> str:
    dated = tmp_path / "inv" / "lake" / "daily" / "2026-11-23T01-00Z"
    dated.mkdir(parents=True)
    (dated / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    for name, body in (data or {}).items():
        (tmp_path / "inv" / "lake" / "daily" / "data").mkdir(exist_ok=True)
        (tmp_path / "inv" / "lake" / "daily" / "data" / name).write_bytes(body)
    return str(dated / "manifest.json")


GOOD = {
    "sourceBucket": "lake",
    "destinationBucket": "arn:aws:s3:::inv",
    "fileFormat": "CSV",
    "fileSchema": CSV_SCHEMA,
    "files": [{"key": "inv/lake/daily/data/a.csv.gz"}],
}


@pytest.mark.parametrize(
    "manifest,data,error",
    [
        ("{not json", None, r"manifest.json is not JSON"),
        (
            {"sourceBucket": "lake"},
            None,
            r"is not an S3 Inventory manifest: it has no destinationBucket, fileFormat, fileSchema, files",
        ),
        ({**GOOD, "fileFormat": "ORC"}, None, r"fileFormat 'ORC' is not supported"),
        ({**GOOD, "fileSchema": "Bucket, Size"}, None, r"fileSchema 'Bucket, Size' has no key field"),
        ({**GOOD, "sourceBucket": "other"}, None, r"lists bucket 'other', not --input's bucket 'lake'"),
        (GOOD, None, r"names 1 data file\(s\) that do not exist, e.g. .*/inv/lake/daily/data/a.csv.gz"),
        ({**GOOD, "files": "a.csv.gz"}, None, r"files must be a list"),
    ],
)
def test_a_malformed_inventory_is_refused_before_the_engine_starts(tmp_path, manifest, data, error):
    uri = _local_inventory(tmp_path, manifest, data)
    cfg = ManifestConfig(input="s3://lake/raw", output=str(tmp_path / "out"), inventory=uri)
    with pytest.raises(ManifestError, match=error) as info:
        check_manifest_inputs(cfg)
    assert uri in str(info.value)


def test_a_missing_inventory_or_a_local_input_is_named(tmp_path):
    missing = str(tmp_path / "nowhere" / "manifest.json")
    with pytest.raises(ManifestError, match=rf"--inventory '{missing}': .*does not exist"):
        check_manifest_inputs(
            ManifestConfig(input="s3://lake/raw", output=str(tmp_path / "o"), inventory=missing)
        )
    uri = _local_inventory(tmp_path, GOOD, {"a.csv.gz": b""})
    check_manifest_inputs(
        ManifestConfig(input="s3://lake/raw", output=str(tmp_path / "o"), inventory=uri)
    )  # well formed
    (tmp_path / "raw").mkdir()
    with pytest.raises(ConfigError, match=r"--inventory .* but --input file://.*/raw is not an s3:// prefix"):
        check_manifest_inputs(
            ManifestConfig(input=str(tmp_path / "raw"), output=str(tmp_path / "o"), inventory=uri)
        )


@pytest.mark.s3
def test_labels_table_with_an_inventory(s3_bucket, tmp_path):
    """``--labels`` with ``--inventory``: the inventory's objects under --input are the flat
    lake, labelled from the table, as a listing of the prefix gives."""
    bucket = s3_bucket[len("s3://") :]
    _upload_lake(bucket)
    inventory = _write_inventory(bucket, "Parquet")
    keys = [
        o["Key"][len("raw/") :]
        for o in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="raw/")["Contents"]
    ]
    lines = ["key,label"] + [
        f"{k},{'cat' if k == 'stray.png' else k.split('/')[0]}" for k in keys if "," not in k
    ]
    table = f"{s3_bucket}/meta/labels.csv"
    boto3.client("s3").put_object(Bucket=bucket, Key="meta/labels.csv", Body="\n".join(lines).encode())
    listed = _manifest(bucket, str(tmp_path / "listed"), labels=table)
    from_inventory = _manifest(bucket, str(tmp_path / "inventory"), labels=table, inventory=inventory)

    assert from_inventory["counts"] == listed["counts"]
    assert from_inventory["fingerprint"] == listed["fingerprint"]
    for name in ("all", "train", "validation", "rejects"):
        a, b = (read_channel(str(tmp_path / d), name) for d in ("listed", "inventory"))
        assert a.to_pylist() == b.to_pylist(), name
    rows = {r["key"]: r for r in read_channel(str(tmp_path / "inventory"), "all").to_pylist()}
    assert (rows["stray.png"]["status"], rows["stray.png"]["label"]) == (
        "ok",
        "cat",
    )  # a path label would reject it
    assert from_inventory["labels_table"]["unlabelled"] == 0
