"""What identifies an object's content, and so the dataset version: a local lake listed without
reading (``--no-sniff``) has no ETag, so its files' size and modification time stand for their
content. A replaced file gives another version; one replaced between the two jobs is a counted
reject, never stored under the old version."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.format import rejects_uri
from tests.helpers.checks import read_table, shard_tables
from tests.helpers.lake import encode, make_image, write_lake


def _build(lake: Path, out: Path, engine, *, overwrite: bool = False) -> str:
    manifest_job.run(
        ManifestConfig(
            input=str(lake),
            output=str(out),
            split="train=0.75,validation=0.25",
            sniff=False,
            overwrite=overwrite,
        ),
        engine,
    )
    return shard_job.run(
        ShardConfig(dataset=str(out), num_shards=2, image_size=16, overwrite=overwrite), engine
    ).dataset_version


def test_no_sniff_local_files_replaced_in_place_give_another_dataset_version(tmp_path: Path, local_engine):
    lake, out = tmp_path / "raw", tmp_path / "ds"
    # BMP: every image of one size has the same number of bytes, so only the content changes.
    paths = write_lake(lake, {"a": 8, "b": 8}, fmt="BMP", nested=False)
    assert len({p.stat().st_size for p in paths}) == 1
    before = _build(lake, out, local_engine)
    for i, p in enumerate(paths):  # every image replaced by another of the same size
        stat = p.stat()
        p.write_bytes(encode(make_image(5000 + i), "BMP"))
        os.utime(p, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert p.stat().st_size == stat.st_size
    after = _build(lake, out, local_engine, overwrite=True)
    assert after != before


def _stored_images(out: Path) -> dict[str, bytes]:
    """Every stored image of the dataset at ``out``, by key."""
    found = {}
    for channel in ("train", "validation"):
        for table in shard_tables(str(out), channel, 2):
            found.update(zip(table["key"].to_pylist(), table["image"].to_pylist()))
    return found


def test_no_sniff_misses_a_same_size_replacement_with_its_mtime_kept_as_the_docs_say(
    tmp_path: Path, local_engine
):
    """The limit of ``--no-sniff`` (size and modification time stand for the content): a file
    replaced by one of the same size with its modification time kept (``cp -p``, ``rsync -a``)
    gives the same version, with the new pixels; docs/jobs.md says so where it sells the option."""
    lake, out = tmp_path / "raw", tmp_path / "ds"
    paths = write_lake(lake, {"a": 8, "b": 8}, fmt="BMP", nested=False)
    before = _build(lake, out, local_engine)
    old_images = _stored_images(out)
    stat = paths[0].stat()
    paths[0].write_bytes(encode(make_image(9000), "BMP"))
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert paths[0].stat().st_size == stat.st_size
    assert _build(lake, out, local_engine, overwrite=True) == before
    new_images = _stored_images(out)
    assert {k for k in old_images if old_images[k] != new_images[k]} == {
        paths[0].relative_to(lake).as_posix()
    }
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "jobs.md").read_text().split())
    assert (
        "A local file replaced by one of the same size with its modification time kept (`cp -p`, "
        "`rsync -a`, `tar x`, `touch -r`;" in docs
    )
    assert "goes unseen: the same `dataset_version`, with the new pixels in its shards." in docs


def test_no_sniff_version_is_stable_when_nothing_changed(tmp_path: Path, local_engine):
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 6, "b": 6}, fmt="BMP", nested=False)
    assert _build(lake, tmp_path / "one", local_engine) == _build(lake, tmp_path / "two", local_engine)


def test_no_sniff_file_replaced_between_the_jobs_is_a_counted_reject(tmp_path: Path, local_engine):
    lake, out = tmp_path / "raw", tmp_path / "ds"
    paths = sorted(write_lake(lake, {"a": 10, "b": 10}, fmt="BMP", nested=False))
    manifest_job.run(
        ManifestConfig(input=str(lake), output=str(out), split="train=1", sniff=False), local_engine
    )
    replaced = paths[4]
    stat = replaced.stat()
    replaced.write_bytes(encode(make_image(9999), "BMP"))  # same size, other pixels, a later mtime
    os.utime(replaced, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    info = shard_job.run(
        ShardConfig(dataset=str(out), num_shards=2, image_size=16, max_reject_fraction=0.2), local_engine
    )
    table = read_table(rejects_uri(str(out), info))
    reasons = dict(zip(table["key"].to_pylist(), table["reason"].to_pylist(), strict=True))
    key = replaced.relative_to(lake).as_posix()
    assert list(reasons) == [key]
    assert reasons[key].startswith("changed since the manifest was built: modified ")
    stored = {u for t in shard_tables(str(out), "train", 2) for u in t["uri"].to_pylist()}
    assert f"file://{replaced}" not in stored
    assert len(stored) == 19 - info.counts.dropped


def test_the_manifest_records_the_content_identity_of_no_sniff_files(tmp_path: Path, local_engine):
    lake, out = tmp_path / "raw", tmp_path / "ds"
    paths = write_lake(lake, {"a": 3, "b": 3}, fmt="BMP", nested=False)
    manifest_job.run(
        ManifestConfig(input=str(lake), output=str(out), split="train=1", sniff=False), local_engine
    )
    table = pq.read_table(next((out / "manifests" / "train").glob("part-*.parquet")))
    assert table.num_rows == len(paths)
    assert table["etag"].null_count == len(paths)  # nothing read: no content hash
    assert table["last_modified"].null_count == 0 and table["size"].null_count == 0
