"""One S3 lake holding every kind of bad object we can make (:func:`helpers.corpus`), through
both engines: every listed object is a manifest row or a reject with a reason, EXIF-rotated
images come out upright, a one-image class fails the split naming it, an empty class prefix is
not a class. S3, not a local folder: only there can a key hold ``/../`` (or ``//``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import boto3
import numpy as np
import pytest
from PIL import Image

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import SplitError
from lakeshard.format import rejects_uri
from lakeshard.format.manifest_table import read_channel
from tests.hardening.helpers import corpus
from tests.helpers.checks import check_dataset, read_table, shard_tables
from tests.helpers.lake import encode, make_image

pytestmark = [pytest.mark.s3, pytest.mark.slow]

# include_hidden: this corpus counts a hidden file as an ordinary object (skipping hidden files by
# default is tested in tests/jobs/engines/test_edge_lake.py).
MANIFEST = {"split_method": "stratified", "seed": 7, "max_reject_fraction": 0.5, "include_hidden": True}
SHARD = {
    "num_shards": 2,
    "image_size": 24,
    "image_format": "png",
    "remainder": "pad",
    "max_reject_fraction": 0.5,
}


def _upload(bucket: str) -> dict[str, bytes]:
    objects = corpus()
    for label, n in {"cls_a": 24, "cls_b": 16, "cls_c": 12}.items():
        for i in range(n):
            objects[f"{label}/img_{i:03d}.png"] = encode(make_image(1000 + 100 * len(label) + i), "PNG")
    client = boto3.client("s3")
    name = bucket[len("s3://") :]
    for key, data in objects.items():
        client.put_object(Bucket=name, Key=f"raw/{key}", Body=data)
    client.put_object(Bucket=name, Key="raw/empty_cls/", Body=b"")  # an empty class prefix (a folder marker)
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=name, Prefix="raw/")["Contents"]}
    assert "raw/cls_b/../bad_dotdot.png" in keys, sorted(keys)  # S3 keeps the key as given
    return objects


def _engine(kind: str, spark, dask_engine_cli):
    if kind == "spark":
        from jobs.common.engines.spark_engine import SparkEngine

        return SparkEngine(spark=spark)
    return dask_engine_cli()


@pytest.fixture()
def spark_if_needed(request):
    return request.getfixturevalue("spark") if request.node.callspec.params["kind"] == "spark" else None


@pytest.mark.parametrize(
    "kind", [pytest.param("spark", marks=pytest.mark.spark), pytest.param("dask", marks=pytest.mark.dask)]
)
def test_bad_corpus_is_accounted_for(kind, s3_bucket, spark_if_needed, dask_engine_cli):
    engine = _engine(kind, spark_if_needed, dask_engine_cli)
    objects = _upload(s3_bucket)
    lake, out = f"{s3_bucket}/raw", f"{s3_bucket}/ds"
    with pytest.raises(SplitError, match=r"'solo' \(train=1, validation=0, test=0\)") as err:
        manifest_job.run(ManifestConfig(input=lake, output=out, **MANIFEST), engine)
    assert "cls_a" not in str(err.value)
    boto3.client("s3").delete_object(Bucket=s3_bucket[len("s3://") :], Key="raw/solo/ok_only.png")
    del objects["solo/ok_only.png"]

    summary = manifest_job.run(ManifestConfig(input=lake, output=out, **MANIFEST), engine)
    info = shard_job.run(ShardConfig(dataset=out, **SHARD), engine)
    check_dataset(out)

    all_rows = read_channel(out, "all")
    listed = sorted(all_rows["key"].to_pylist())
    # The folder marker of the empty class prefix is an object too: listed, and rejected.
    assert listed == sorted([*objects, "empty_cls/"]), set(listed) ^ {*objects, "empty_cls/"}
    assert summary["counts"]["listed"] == len(objects) + 1
    labels = json.loads(storage.read_bytes(f"{out}/labels.json"))
    assert sorted(labels) == ["cls_a", "cls_b", "cls_c", "ünï cls"]  # no empty_cls, no solo

    # Listed = channel manifests + manifest rejects, each with a reason; then shards + shard rejects.
    m_rejects = dict(zip(*(read_channel(str(out), "rejects")[c].to_pylist() for c in ("key", "reason"))))
    s_rejects = dict(
        zip(*(read_table(rejects_uri(str(out), info))[c].to_pylist() for c in ("key", "reason")))
    )
    in_channels = [k for c in info.channels for k in read_channel(out, c)["key"].to_pylist()]
    assert sorted(in_channels + list(m_rejects)) == listed
    assert all(m_rejects.values()) and all(s_rejects.values())
    in_shards = {}
    for c in info.channels:
        for t in shard_tables(out, c, SHARD["num_shards"]):
            in_shards.update(zip(t["key"].to_pylist(), t["image"].to_pylist()))
    for key in objects:
        if "bad_" in key.rsplit("/", 1)[-1] or key.startswith("bad_"):
            assert key in m_rejects or key in s_rejects, f"{key} was not rejected"
        else:
            assert key in in_shards, (
                f"{key} is in no shard (manifest reject: {m_rejects.get(key)}, shard reject: {s_rejects.get(key)})"
            )

    assert m_rejects["cls_b/../bad_dotdot.png"].startswith("unsafe key")
    assert m_rejects["cls_b/./bad_dot.png"].startswith("unsafe key")
    assert m_rejects["cls_b//bad_empty_component.png"].startswith("unsafe key")
    assert m_rejects["empty_cls/"], m_rejects
    assert m_rejects["bad_stray_top.png"].startswith("no label")
    assert m_rejects["cls_a/bad_zero.jpg"].startswith("empty object")
    for key in ("cls_a/bad_text.jpg", "cls_a/bad_html.jpg", "cls_a/bad_gzip.png", "cls_a/bad_notes.txt"):
        assert m_rejects[key].startswith("not an image"), (key, m_rejects[key])
    assert s_rejects["cls_a/bad_bomb.png"].startswith("decompression bomb"), s_rejects["cls_a/bad_bomb.png"]
    for key in (
        "cls_a/bad_truncated.jpg",
        "cls_a/bad_corrupt.png",
        "cls_a/bad_png_header_only.png",
        "cls_a/bad_jpeg_soi_only.jpg",
    ):
        assert s_rejects[key].startswith("cannot decode"), (key, s_rejects[key])

    for key in ("cls_a/ok_upright_probe.jpg", "cls_a/ok_exif_rotated.jpg"):
        img = Image.open(io.BytesIO(in_shards[key]))
        assert img.mode == "RGB" and img.size == (24, 24)
    probe = np.asarray(Image.open(io.BytesIO(in_shards["cls_a/ok_upright_probe.jpg"])), dtype=float)
    assert probe[:6].mean() > 200 and probe[-6:].mean() < 60, "the EXIF-rotated probe is not upright"


def test_local_lake_cannot_hold_a_dotdot_key(tmp_path: Path):
    """Why the corpus lives on S3: a local path component ``..`` is the parent folder."""
    (tmp_path / "raw" / "cls").mkdir(parents=True)
    (tmp_path / "raw" / "cls" / ".." / "x.png").write_bytes(b"x")
    assert (tmp_path / "raw" / "x.png").exists()
