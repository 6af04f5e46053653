"""Issue 24, engine-free: links, hidden files, identical content, output inside input, one class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from jobs import manifest as manifest_job
from jobs.manifest_steps.catalog import build_manifest
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.manifest_steps.listing import Skip, discover, list_prefix
from lakeshard import storage
from lakeshard.errors import ConfigError, ManifestError, RejectFractionError
from tests.helpers.edge_lake import HIDDEN, write_edge_lake
from tests.helpers.lake import encode, make_image


def _listing(raw: Path, skip: Skip) -> dict[str, dict[str, Any]]:
    prefixes, stray = discover(str(raw), skip=skip)
    rows = stray + [r for p in prefixes for r in list_prefix(str(raw), p, skip=skip)]
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys))
    return {r["key"]: r for r in rows}


def test_links_are_followed_or_rejected_by_reason_and_hidden_objects_skipped(tmp_path):
    raw = write_edge_lake(tmp_path)
    (raw / "ghost").symlink_to("../no-such-class")  # a dangling link where a class would be
    (raw / "fox" / "linked.png").symlink_to("../../more-cats-x/img_00000.png")  # a file link
    rows = _listing(raw, Skip(exclude=("*.tmp",)))
    ok = {k for k, r in rows.items() if r["status"] == "ok"}
    assert {f"cat2/img_{i:05d}.png" for i in range(6)} <= ok  # a class that is a link
    assert {f"dog/linked/img_{i:05d}.png" for i in range(4)} <= ok  # a folder link inside a class
    assert rows["cat2/img_00000.png"]["label"] == "cat2" and rows["cat2/img_00000.png"]["size"] > 0
    assert "fox/linked.png" in ok and rows["fox/linked.png"]["size"] == rows["cat2/img_00000.png"]["size"]
    assert not any("more-cats" in k or "extra-dogs" in k or k.startswith("dog/loop/") for k in rows)
    reasons = {k: r["reason"] for k, r in rows.items() if r["status"] == "rejected"}
    assert reasons == {
        "dog/loop": "symlink loop: loop -> '..' leads back to a folder above it",
        "cat/dangling.png": "dangling symlink: dangling.png -> 'nowhere.png', which does not exist",
        "cat/selfloop.png": "symlink loop: selfloop.png -> 'selfloop.png' never resolves",
        "ghost": "dangling symlink: ghost -> '../no-such-class', which does not exist",
    }
    skipped = {k: r["reason"] for k, r in rows.items() if r["status"] == "skipped"}
    assert set(skipped) == {*HIDDEN, "cat/notes.tmp"}
    assert skipped["cat/notes.tmp"] == "excluded: --exclude '*.tmp'"
    assert skipped["cat/.ipynb_checkpoints/img_00000-checkpoint.png"] == "hidden: '.ipynb_checkpoints'"

    shown = _listing(raw, Skip(include_hidden=True))
    assert {k for k, r in shown.items() if r["status"] == "skipped"} == set()
    assert set(HIDDEN) | {"cat/notes.tmp"} <= set(shown)


@pytest.mark.parametrize(
    "key,pattern,skipped",
    [
        ("cat/a.tmp", "*.tmp", True),
        ("cat/drafts/a.png", "drafts", True),
        ("cat/old/a.png", "cat/old/*", True),
        ("dog/old/a.png", "cat/old/*", False),
        ("cat/a.png", "*.tmp", False),
        ("cat/.keep/a.png", None, True),
        ("cat/x/../a.png", None, False),  # '..' is an unsafe key (rejected), not a hidden name
    ],
)
def test_skip_rules(key, pattern, skipped):
    assert (Skip(exclude=(pattern,) if pattern else ()).reason(key) is not None) is skipped


def _row(key: str, content: str, status: str = "ok") -> dict[str, Any]:
    return {
        "uri": f"file:///raw/{key}",
        "key": key,
        "label": key.split("/")[0],
        "label_index": None,
        "channel": None,
        "size": 10,
        "etag": content,
        "content": content,
        "last_modified": None,
        "format": "png",
        "status": status,
        "reason": None if status == "ok" else "not an image: x",
    }


def _lake_rows() -> list[dict[str, Any]]:
    rows = [_row(f"{label}/{i}.png", f"{label}{i}") for label in ("a", "b") for i in range(20)]
    rows += [_row(f"a/copy{i}.png", "same") for i in range(6)]  # one image, six keys
    rows += [_row("b/copy_of_a0.png", "a0")]  # the same image under two labels
    return rows


def test_identical_content_across_channels_is_reported():
    m = build_manifest(_lake_rows(), split={"train": 0.5, "validation": 0.5}, seed=3)
    channel = dict(zip(m.all["key"].to_pylist(), m.all["channel"].to_pylist()))
    copies = {channel[f"a/copy{i}.png"] for i in range(6)}
    d = m.duplicates
    assert (d["groups"], d["objects"], d["across_labels"], d["removed"]) == (2, 8, 1, 0)
    leaking = [copies, {channel["a/0.png"], channel["b/copy_of_a0.png"]}]
    assert d["across_channels"] == sum(len(c) > 1 for c in leaking) >= 1
    assert all(len(set(e.values())) > 1 for e in d["examples"])
    assert m.rejects.num_rows == 0


def test_dedupe_keeps_the_first_key_and_no_content_is_in_two_channels():
    rows = _lake_rows()
    m = build_manifest(
        rows, split={"train": 0.5, "validation": 0.5}, seed=3, dedupe=True, max_reject_fraction=0.0
    )
    reasons = dict(zip(m.rejects["key"].to_pylist(), m.rejects["reason"].to_pylist()))
    assert reasons == {
        **{f"a/copy{i}.png": "duplicate: same content as 'a/copy0.png'" for i in range(1, 6)},
        "b/copy_of_a0.png": "duplicate: same content as 'a/0.png'",
    }
    ok = m.all.filter(pc.equal(m.all["status"], "ok"))
    assert len(set(ok["etag"].to_pylist())) == ok.num_rows == len(rows) - 6
    assert (m.duplicates["groups"], m.duplicates["removed"]) == (0, 6)
    # Other rejects still count against the budget (the copies do not).
    with pytest.raises(RejectFractionError, match="1 of 42 listed objects"):
        build_manifest(
            [*rows, _row("a/junk.png", "j", "rejected")],
            split={"train": 1.0},
            seed=3,
            dedupe=True,
            max_reject_fraction=0.0,
        )


def test_one_class_is_refused():
    rows = [_row(f"a/{i}.png", str(i)) for i in range(5)] + [_row("b/bad.png", "x", "rejected")]
    with pytest.raises(
        ManifestError, match=r"at least 2 classes, but /raw has usable images in 1 class only: 'a'"
    ):
        build_manifest(rows, split={"train": 1.0}, seed=0, source="/raw")


@pytest.mark.parametrize(
    "output,where",
    [("raw", "is the input"), ("raw/ds", "is inside the input"), ("link-to-raw/ds", "is inside the input")],
)
def test_output_inside_input_is_refused_before_any_work(tmp_path, output, where):
    (tmp_path / "raw" / "a").mkdir(parents=True)
    (tmp_path / "link-to-raw").symlink_to(tmp_path / "raw")
    cfg = ManifestConfig(input=str(tmp_path / "raw"), output=str(tmp_path / output))
    with pytest.raises(
        ConfigError, match=rf"--output file://{tmp_path}/{output} {where} --input file://{tmp_path}/raw"
    ):
        check_manifest_inputs(cfg)
    with pytest.raises(ConfigError, match=where):
        manifest_job.run(cfg, engine=None)  # refused before the engine is touched
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["a"]


@pytest.mark.parametrize("src,out", [("s3://b/raw", "s3://b/raw/ds"), ("s3://b/raw", "s3://b/raw")])
def test_output_inside_an_s3_input_is_refused(src, out):
    with pytest.raises(ConfigError, match=f"--output {out} .* --input {src}"):
        check_manifest_inputs(ManifestConfig(input=src, output=out))


@pytest.mark.parametrize("src,out", [("s3://b/raw", "s3://b/raw2/ds"), ("s3://b/raw/cat", "s3://b/raw")])
def test_output_beside_or_above_the_input_is_allowed(src, out):
    check_manifest_inputs(ManifestConfig(input=src, output=out))


@pytest.mark.s3
def test_s3_content_identity_sees_through_multipart_etags(s3_bucket):
    """A multipart ETag ('<hash>-<parts>') is not the content's MD5: such an object is hashed,
    so the same bytes uploaded whole and in parts are one content; distinct bytes are not."""
    import boto3

    from jobs.manifest_steps.listing import inspect_objects

    bucket = s3_bucket[len("s3://") :]
    client = boto3.client("s3")
    image = encode(make_image(11), "PNG")
    big = image + b"\0" * (
        5 * 2**20
    )  # trailing bytes after IEND: still that PNG; multipart needs 5 MiB parts
    upload = client.create_multipart_upload(Bucket=bucket, Key="raw/b/parts.png")
    parts = []
    for n, chunk in enumerate((big[: 5 * 2**20], big[5 * 2**20 :]), start=1):
        etag = client.upload_part(
            Bucket=bucket, Key="raw/b/parts.png", UploadId=upload["UploadId"], PartNumber=n, Body=chunk
        )["ETag"]
        parts.append({"PartNumber": n, "ETag": etag})
    client.complete_multipart_upload(
        Bucket=bucket, Key="raw/b/parts.png", UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )
    client.put_object(Bucket=bucket, Key="raw/a/whole.png", Body=big)
    client.put_object(Bucket=bucket, Key="raw/a/other.png", Body=image)
    client.put_object(Bucket=bucket, Key="raw/b/own.png", Body=encode(make_image(12), "PNG"))
    raw = f"{s3_bucket}/raw"
    prefixes, _ = discover(raw)
    rows = {r["key"]: r for r in inspect_objects([r for p in prefixes for r in list_prefix(raw, p)])}
    assert "-" in rows["b/parts.png"]["etag"] and "-" not in rows["a/whole.png"]["etag"]
    assert all(r["status"] == "ok" for r in rows.values())
    m = build_manifest(list(rows.values()), split={"train": 1.0}, seed=0, dedupe=True)
    reasons = dict(zip(m.rejects["key"].to_pylist(), m.rejects["reason"].to_pylist()))
    assert reasons == {"b/parts.png": "duplicate: same content as 'a/whole.png'"}


@pytest.mark.parametrize(
    "scheme", [pytest.param("gs", marks=pytest.mark.gcs), pytest.param("az", marks=pytest.mark.azure)]
)
def test_gcs_and_azure_objects_are_identified_by_their_listed_md5_and_read_only_to_their_header(
    scheme: str, request: pytest.FixtureRequest
):
    """A GCS md5Hash and an Azure Content-MD5 are the content's identity, as S3's ETag: only the
    first 512 bytes of such an object are read. An Azure blob committed from blocks states no
    MD5: it is read whole and hashed, and is still the same content as its twin put in one go."""
    import hashlib

    from jobs.manifest_steps.listing import inspect_objects

    one, two, three = (encode(make_image(seed), "PNG") for seed in (21, 22, 23))
    assert min(map(len, (one, two, three))) > 2048
    root = request.getfixturevalue("gcs_bucket" if scheme == "gs" else "az_container")
    bucket = root.split("://", 1)[1]
    objects = {"raw/a/one.png": one, "raw/a/two.png": two, "raw/b/three.png": three, "raw/b/copy.png": one}
    for key, data in objects.items():
        storage.write_bytes_atomic(f"{root}/{key}", data)
    whole = set()
    if scheme == "az":
        from azure.storage.blob import BlobBlock

        from lakeshard.storage import azure_client

        blob = azure_client().get_blob_client(bucket, "raw/b/blocks.png")
        blob.stage_block("YQ==", one[:1000])
        blob.stage_block("Yg==", one[1000:])
        blob.commit_block_list([BlobBlock("YQ=="), BlobBlock("Yg==")])
        objects["raw/b/blocks.png"], whole = one, {"raw/b/blocks.png"}
    raw = f"{root}/raw"
    prefixes, _ = discover(raw)
    rows = {r["key"]: r for r in inspect_objects([r for p in prefixes for r in list_prefix(raw, p)])}
    assert {k: (r["status"], r["format"], r["reason"]) for k, r in rows.items()} == {
        k.removeprefix("raw/"): ("ok", "png", None) for k in objects
    }
    assert {k: r["content"] for k, r in rows.items()} == {
        k.removeprefix("raw/"): hashlib.md5(d).hexdigest() for k, d in objects.items()
    }
    if scheme == "gs":
        reads = request.getfixturevalue("gcs_emulator").reads(bucket)
    else:
        from tests.helpers.azurite import blob_reads

        reads = blob_reads(request.getfixturevalue("azurite"), bucket)
    assert sorted(k for k, _ in reads) == sorted(objects)  # one GET each
    for key, asked in reads:
        if key in whole:  # all of it: no range, or one from 0 past its end
            first, _, last = (asked or "bytes=0-").removeprefix("bytes=").partition("-")
            assert first == "0" and (not last or int(last) + 1 >= len(one)), asked
        else:
            assert asked == "bytes=0-511", (key, asked)
    m = build_manifest(list(rows.values()), split={"train": 1.0}, seed=0, dedupe=True)
    reasons = dict(zip(m.rejects["key"].to_pylist(), m.rejects["reason"].to_pylist()))
    assert reasons == {
        k.removeprefix("raw/"): "duplicate: same content as 'a/one.png'"
        for k in objects
        if k in ("raw/b/copy.png", "raw/b/blocks.png")
    }
