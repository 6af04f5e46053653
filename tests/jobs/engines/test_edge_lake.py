"""Issue 24 on both engines: one lake with links, hidden files, copies of one image and formats
beyond JPEG and PNG goes through the manifest job (with and without ``dedupe``) and the shard job."""

from __future__ import annotations

from collections import defaultdict

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.errors import ManifestError
from lakeshard.format import ManifestInfo, read_manifest_info, shard_rejects_uri
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import check_dataset, read_table, shard_tables
from tests.helpers.edge_lake import EXTRA_FORMATS, HIDDEN, write_edge_lake
from tests.helpers.lake import write_lake

OPTS = {
    "split": "train=0.5,validation=0.5",
    "split_method": "stratified",
    "seed": 7,
    "max_reject_fraction": 0.2,
    "exclude": ("*.tmp",),
}


@pytest.fixture(
    params=[pytest.param("spark", marks=pytest.mark.spark), pytest.param("dask", marks=pytest.mark.dask)]
)
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


def _ok_rows(out: str) -> list[dict]:
    return [r for r in read_channel(out, "all").to_pylist() if r["status"] == "ok"]


def _channels_by_content(rows: list[dict]) -> dict[str, set[str]]:
    by_content: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        by_content[r["etag"]].add(r["channel"])
    return by_content


def test_edge_lake_is_listed_reported_deduped_and_sharded(engine, tmp_path):
    raw = write_edge_lake(tmp_path)
    out = str(tmp_path / "ds")
    summary = manifest_job.run(ManifestConfig(input=str(raw), output=out, engine=engine.name, **OPTS), engine)

    rows = {r["key"]: r for r in read_channel(out, "all").to_pylist()}
    ok = {k for k, r in rows.items() if r["status"] == "ok"}
    assert {f"cat2/img_{i:05d}.png" for i in range(6)} | {
        f"dog/linked/img_{i:05d}.png" for i in range(4)
    } <= ok
    assert {k: rows[k]["reason"].split(":")[0] for k in rows if rows[k]["status"] == "rejected"} == {
        "dog/loop": "symlink loop",
        "cat/selfloop.png": "symlink loop",
        "cat/dangling.png": "dangling symlink",
    }
    assert {rows[f"fox/{name}"]["format"] for name in EXTRA_FORMATS} == {"ico", "jpeg2000", "ppm", "tga"}
    assert not set(HIDDEN) & set(rows) and "cat/notes.tmp" not in rows
    assert summary["counts"]["skipped"] == len(HIDDEN) + 1
    assert summary["skipped_by_reason"] == {"excluded: --exclude '*.tmp'": 1, "hidden": len(HIDDEN)}
    assert (
        set(summary["skipped_examples"]) <= {*HIDDEN, "cat/notes.tmp"}
        and len(summary["skipped_examples"]) == 5
    )
    assert summary["counts"]["listed"] == len(rows) and "__MACOSX" not in summary["labels"]

    # Copies: dup/copy_0..7 (8 of the 10 in a class split in halves: in both channels) and
    # cat/img_00001.png = fox/copy_of_cat.png.
    by_content = _channels_by_content(_ok_rows(out))
    d = summary["duplicates"]
    assert (d["groups"], d["objects"], d["across_labels"], d["removed"]) == (2, 10, 1, 0)
    assert d["across_channels"] == sum(len(c) > 1 for c in by_content.values()) >= 1
    written = read_manifest_info(str(tmp_path / "ds"))
    assert written.duplicates == ManifestInfo.from_json(summary).duplicates
    assert written.counts.skipped == len(HIDDEN) + 1

    summary = manifest_job.run(
        ManifestConfig(input=str(raw), output=out, engine=engine.name, dedupe=True, overwrite=True, **OPTS),
        engine,
    )
    rejects = read_channel(out, "rejects").to_pylist()
    dupes = {r["key"]: r["reason"] for r in rejects if r["reason"].startswith("duplicate")}
    assert dupes == {
        **{f"dup/copy_{i}.png": "duplicate: same content as 'dup/copy_0.png'" for i in range(1, 8)},
        "fox/copy_of_cat.png": "duplicate: same content as 'cat/img_00001.png'",
    }
    assert all(len(c) == 1 for c in _channels_by_content(_ok_rows(out)).values())
    assert (summary["duplicates"]["groups"], summary["duplicates"]["removed"]) == (0, 8)

    info = shard_job.run(
        ShardConfig(
            dataset=out,
            engine=engine.name,
            num_shards=1,
            image_size=16,
            image_format="png",
            max_reject_fraction=0.0,
        ),
        engine,
    )
    check_dataset(out)
    assert read_table(shard_rejects_uri(out)).num_rows == 0
    in_shards = {u for c in info.channels for t in shard_tables(out, c, 1) for u in t["uri"].to_pylist()}
    dropped = {u for e in info.channels.values() for u in e.dropped}
    assert all(f"file://{raw}/fox/{name}" in in_shards | dropped for name in EXTRA_FORMATS)


def test_one_class_lake_is_refused(engine, tmp_path):
    write_lake(tmp_path / "raw", {"only": 12})
    with pytest.raises(ManifestError, match=r"at least 2 classes.* 1 class only: 'only'"):
        manifest_job.run(
            ManifestConfig(input=str(tmp_path / "raw"), output=str(tmp_path / "ds"), engine=engine.name),
            engine,
        )
    assert not (tmp_path / "ds" / "manifests" / "_manifest.json").exists()
