"""URIs: the name after the scheme is taken literally, as the AWS CLI takes an ``s3://`` URI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lakeshard import storage
from lakeshard.errors import StorageError


@pytest.mark.parametrize(
    "name", ["photo #1.png", "what?.png", "a+b=c&d.png", "pre%20encoded.png", "日本 語.png"]
)
def test_uri_syntax_in_a_name_stays_in_the_name(tmp_path, name):
    path = tmp_path / "cls" / name
    path.parent.mkdir()
    path.write_bytes(name.encode())
    uri = storage.join(f"file://{tmp_path}", "cls", name)
    assert uri == f"file://{path}"
    assert storage.normalize(uri) == uri
    assert storage.read_bytes(uri) == name.encode()
    assert storage.normalize(f"s3://bucket/raw/{name}") == f"s3://bucket/raw/{name}"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/", "s3://bucket"),
        ("S3A://bucket/key/", "s3://bucket/key"),
        ("s3://bucket//a/b", "s3://bucket/a/b"),
        ("file:///abs/dir/", "file:///abs/dir"),
    ],
)
def test_normalize_gives_the_canonical_form(uri, expected):
    assert storage.normalize(uri) == expected


def test_relative_and_home_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert storage.normalize("rel/p") == f"file://{tmp_path}/rel/p"
    assert storage.normalize("file:rel") == f"file://{tmp_path}/rel"
    assert storage.normalize("~/x") == f"file://{tmp_path}/home/x"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3:///key", "names no bucket"),
        ("s3:bucket/key", "names no bucket"),
        ("http://host/x", "unsupported URI scheme 'http'"),
        ("", "non-empty string"),
    ],
)
def test_bad_uris_are_refused_by_name(uri, message):
    with pytest.raises(StorageError, match=message):
        storage.normalize(uri)


def test_remove_temporaries_deletes_only_what_killed_writers_left(tmp_path):
    """A writer killed between writing its temporary sibling and renaming it leaves
    ``<name>.tmp-<32 hex>``; nothing else is touched, however alike its name."""
    stale = [tmp_path / "train" / "part-00000-of-00003.parquet", tmp_path / "dataset.json"]
    stale = [storage.temp_sibling(str(p)) for p in stale]
    kept = [
        tmp_path / "train" / "part-00001-of-00003.parquet",
        tmp_path / "notes.tmp-1234",
        tmp_path / f"x.tmp-{'a' * 32}.parquet",
        tmp_path / f"y.tmp-{'A' * 32}",
    ]
    for p in [*map(Path, stale), *kept]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    removed = storage.remove_temporaries(f"file://{tmp_path}")
    assert sorted(removed) == sorted(stale)
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted(kept)
    assert storage.remove_temporaries(f"file://{tmp_path}") == []
    assert storage.remove_temporaries(f"file://{tmp_path}/missing") == []
    assert storage.remove_temporaries("s3://bucket/ds") == []  # S3 writes have no temporaries


def test_only_local_files_are_moved(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x")
    storage.move(str(tmp_path / "a"), str(tmp_path / "b" / "c"))
    assert (tmp_path / "b" / "c" / "f").read_bytes() == b"x" and not (tmp_path / "a").exists()
    # S3 has no rename: a move there would copy every byte, so it is refused before any request
    # (no endpoint is configured here: a request would fail otherwise).
    for src, dst in [
        ("s3://bucket/ds/_staging", "s3://bucket/ds/shards"),
        (str(tmp_path / "b"), "s3://bucket/x"),
    ]:
        with pytest.raises(
            StorageError, match=r"^cannot move .* to s3://bucket/\S+: only local files are renamed"
        ):
            storage.move(src, dst)
    with pytest.raises(StorageError, match=r"cannot move file://\S+/missing to"):
        storage.replace(str(tmp_path / "missing"), str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("durable", [True, False])
def test_an_atomic_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path, durable: bool):
    """``durable=False`` (a job's scratch files) skips only the fsync: the file is still
    written under a temporary name and renamed onto the old one."""
    target = tmp_path / "d" / "f.parquet"
    storage.write_bytes_atomic(str(target), b"old", durable=durable)
    storage.write_bytes_atomic(str(target), b"new bytes", durable=durable)
    assert target.read_bytes() == b"new bytes"
    assert [p.name for p in target.parent.iterdir()] == ["f.parquet"]


def test_which_store_a_uri_names_is_decided_in_one_place(tmp_path):
    from lakeshard import storage as st

    assert [st.scheme(u) for u in ("s3://b/k", "s3a://b/k", "file:///x", "rel/path")] == [
        "s3",
        "s3",
        "file",
        "file",
    ]
    assert [st.is_local(u) for u in ("s3://b/k", "file:///x", "/abs", "rel", "C:/x")] == [
        False,
        True,
        True,
        True,
        True,
    ]
    assert [st.is_uri(u) for u in ("s3://b/k", "file:///x", "/abs", "s3:b/k", "hdfs://b/k")] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert st.local_path(f"file://{tmp_path}/a/") == f"{tmp_path}/a"
    assert st.local_path("rel/x") == os.path.abspath("rel/x")
    assert st.bucket("s3://lake/raw/cat/1.jpg") == "lake"
    assert st.from_listing("s3://lake/raw", "lake/raw/cat/1.jpg") == "s3://lake/raw/cat/1.jpg"
    assert st.from_listing(str(tmp_path), f"{tmp_path}/cat/1.jpg") == f"file://{tmp_path}/cat/1.jpg"
    with pytest.raises(StorageError, match="not a local path: 's3://lake/x'"):
        st.local_path("s3://lake/x")
    with pytest.raises(StorageError, match="unsupported URI scheme 'hdfs'"):
        st.scheme("hdfs://b/k")
