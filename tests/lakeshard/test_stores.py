"""The store seam (:mod:`lakeshard.storage`, design/0036): a URI's store is picked by its scheme
in one table, a registered scheme is used everywhere a URI is, and every store keeps the same
contract: a local folder, the moto S3 server and the GCS emulator of tests/conftest.py and a store of memory
(``tests/helpers/mem_store.py``, what a new store plugs in) each pass the same tests."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakeshard import storage
from lakeshard.errors import StorageError
from lakeshard.storage import AzureStore, GCSStore, LocalStore, RequestStats, S3Store, Store
from tests.helpers.mem_store import MemStore


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _etag(store: Store, uri: str, data: bytes) -> str:
    """The ETag of an object written in one upload: its MD5 (S3's, and computed for a local file
    or in memory), or elsewhere (a GCS generation, Azure's ETag) the one the listing gives."""
    if not isinstance(store, (GCSStore, AzureStore)):
        return _md5(data)
    etag = store.listed_etag(store.filesystem().info(store.path(uri)))
    assert etag is not None, uri
    return etag


@pytest.fixture()
def mem_scheme() -> Iterator[None]:
    """``mem://`` registered for one test."""
    storage.register_store("mem", MemStore)
    try:
        yield
    finally:
        storage.unregister_store("mem")


def test_the_registry_picks_the_store_by_scheme(tmp_path: Path):
    for uri in (str(tmp_path), f"file://{tmp_path}", "rel/path", "~/x", "file:rel", "C:/x"):
        assert isinstance(storage.store_for(uri), LocalStore), uri
    for uri in ("s3://bucket/key", "S3://bucket", "s3a://bucket/key"):
        assert isinstance(storage.store_for(uri), S3Store), uri
    for uri in ("az://container/blob", "abfs://container/blob", "abfss://c@acct.dfs.core.windows.net/b"):
        assert isinstance(storage.store_for(uri), AzureStore), uri
    for uri in ("gs://bucket/key", "GS://bucket", "gcs://bucket/key"):
        assert isinstance(storage.store_for(uri), GCSStore), uri
    assert storage.normalize("gcs://b/k/") == "gs://b/k" and storage.scheme("gcs://b") == "gs"
    assert storage.store_for("s3://a") is storage.store_for("s3a://b")  # one store a process
    assert storage.store_for(str(tmp_path)).local and not storage.store_for("s3://b").local


@pytest.mark.parametrize("uri", ["hdfs://namenode/key", "wasbs://container/x", "http://host/x"])
def test_an_unknown_scheme_is_refused_naming_the_uri(uri: str):
    with pytest.raises(StorageError) as err:
        storage.store_for(uri)
    name = uri.partition(":")[0]
    assert str(err.value) == (
        f"unsupported URI scheme {name!r} in {uri!r}: use a local path, file://, s3://, gs:// or az://"
    )
    assert not storage.is_local(uri) and not storage.is_uri(uri)
    for call in (storage.normalize, storage.read_bytes, storage.exists, storage.scheme):
        with pytest.raises(StorageError, match=f"unsupported URI scheme {name!r} in {uri!r}"):
            call(uri)
    with pytest.raises(StorageError, match="non-empty string"):
        storage.store_for("")


def test_a_registered_scheme_is_used_wherever_a_uri_is(mem_scheme: None):
    """Once registered, ``mem://`` is a store like the others: :func:`store_for` gives it, the
    functions by URI and the names of a URI go through it; unregistered, it is refused again."""
    store = storage.store_for("mem://b/k")
    assert isinstance(store, MemStore) and storage.store_for("MEM://other") is store
    assert storage.normalize("mem://b//a/") == "mem://b/a" and storage.scheme("mem://b/a") == "mem"
    assert storage.is_uri("mem://b/a") and not storage.is_local("mem://b/a")
    storage.write_json_atomic(storage.join("mem://b", "d", "x.json"), {"a": 1})
    assert storage.read_json("mem://b/d/x.json") == {"a": 1} and storage.exists("mem://b/d/x.json")
    fs, path = storage.filesystem("mem://b/d")
    assert [storage.from_listing("mem://b", p) for p in fs.find(path)] == ["mem://b/d/x.json"]
    assert storage.bucket("mem://b/d/x.json") == "b"
    etag = storage.create_if_absent("mem://b/lock", b"1")
    assert etag == _md5(b"1") and storage.create_if_absent("mem://b/lock", b"2") is None
    assert storage.remove_if_unchanged("mem://b/lock", etag)
    storage.remove("mem://b/d", recursive=True)
    assert not storage.exists("mem://b/d/x.json")
    with pytest.raises(
        StorageError,
        match="unsupported URI scheme 'hdfs' in 'hdfs://b': use a local path, file://, s3://, gs://, az:// or mem://",
    ):
        storage.store_for("hdfs://b")
    with pytest.raises(StorageError, match="has a store already"):
        storage.register_store("mem", MemStore)
    with pytest.raises(StorageError, match="two or more characters"):
        storage.register_store("c", MemStore)
    storage.unregister_store("mem")
    with pytest.raises(StorageError, match="unsupported URI scheme 'mem'"):
        storage.store_for("mem://b/k")
    storage.register_store("mem", MemStore)  # for the fixture to remove


def test_abfs_uris_name_az_blobs_of_the_accounts_own_host(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    assert storage.normalize("abfs://c/raw/x/") == "az://c/raw/x"
    assert storage.normalize("abfss://c@acct.dfs.core.windows.net/raw") == "az://c/raw"
    assert storage.normalize("az://c") == "az://c" and storage.scheme("abfs://c/k") == "az"
    with pytest.raises(
        StorageError, match=r"names the account host 'other\.dfs\.core\.windows\.net'.*az://c/"
    ):
        storage.normalize("abfs://c@other.dfs.core.windows.net/raw")
    with pytest.raises(StorageError, match=r"^Azure URI 'az:///k' names no container$"):
        storage.normalize("az:///k")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
    with pytest.raises(StorageError, match=r"^no Azure credentials: set AZURE_STORAGE_CONNECTION_STRING"):
        storage.store_for("az://c").filesystem()


def test_a_move_between_stores_is_refused_naming_both(tmp_path: Path, mem_scheme: None):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(
        StorageError, match=rf"^cannot move file://{tmp_path}/f to mem://b/f: only local files"
    ):
        storage.replace(str(tmp_path / "f"), "mem://b/f")
    assert (tmp_path / "f").read_bytes() == b"x"


# -- the contract, for every store ------------------------------------------------------------------
@pytest.fixture(
    params=[
        "local",
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("az", marks=pytest.mark.azure),
        pytest.param("gs", marks=pytest.mark.gcs),
        "mem",
    ]
)
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty folder or prefix of each store, as a canonical URI."""
    if request.param == "local":
        yield f"file://{tmp_path}"
    elif request.param == "s3":
        yield f"{request.getfixturevalue('s3_bucket')}/root"
    elif request.param == "az":
        yield f"{request.getfixturevalue('az_container')}/root"
    elif request.param == "gs":
        yield f"{request.getfixturevalue('gcs_bucket')}/root"
    else:
        storage.register_store("mem", MemStore)
        try:
            yield f"mem://{tmp_path.name}"
        finally:
            storage.remove(f"mem://{tmp_path.name}", recursive=True)
            storage.unregister_store("mem")


def test_names_go_from_uri_to_path_and_back_through_the_listing(root: str):
    store = storage.store_for(root)
    uri = f"{root}/a b/#1?.bin"
    assert store.normalize(uri + "/") == uri and store.normalize(uri) == uri
    assert store.uri(store.path(uri)) == uri
    assert store.path(root + "/prefix/").endswith("/prefix/")  # a prefix stays one
    store.write_atomic(uri, b"x")
    assert [store.uri(p) for p in store.filesystem().find(store.path(root))] == [uri]


def test_reads_whole_in_ranges_and_from_the_end(root: str):
    store = storage.store_for(root)
    uri, data = f"{root}/d/blob", bytes(range(256)) * 40
    store.write_atomic(uri, data)
    assert store.exists(uri) and not store.exists(f"{root}/d/other")
    assert store.read(uri) == data
    assert store.read(uri, 10, 300) == data[10:300]
    assert store.read(uri, 0, 7) == data[:7] and store.read(uri, 9000) == data[9000:]
    assert store.read(uri, 10_000, 20_000) == data[10_000:]  # a range past the end: what there is
    tail = store.read_tail(uri, 100)
    assert (tail.data, tail.size) == (data[-100:], len(data))
    whole = store.read_tail(uri, 1 << 20)
    assert (whole.data, whole.size) == (data, len(data))
    got = store.get(uri)
    assert got.data == data and got.etag == _etag(store, uri, data)
    assert tail.etag in (None, got.etag) and 0 <= got.age_s < 600
    for read in (store.read, store.get, lambda u: store.read_tail(u, 10)):
        with pytest.raises(FileNotFoundError):
            read(f"{root}/d/missing")


def test_a_listing_states_the_md5_of_what_one_upload_wrote(root: str):
    """S3's ETag, GCS's md5Hash and Azure's Content-MD5 are the MD5 of the bytes (hex): the
    manifest job then reads an image's header only. A local file's listing states none (it is
    read whole to hash it), nor does an Azure ETag or a GCS generation pass for one, nor does the
    in-memory filesystem's."""
    store = storage.store_for(root)
    uri, data = f"{root}/m/blob", bytes(range(256)) * 7
    store.write_atomic(uri, data)
    (info,) = store.filesystem().find(store.path(f"{root}/m"), detail=True).values()
    expected = _md5(data) if isinstance(store, (S3Store, GCSStore, AzureStore)) else None  # mem: none listed
    assert store.listed_md5(info) == expected
    assert store.listed_md5(store.filesystem().info(store.path(uri))) == expected
    assert store.listed_md5({"name": store.path(uri), "size": len(data)}) is None  # a listing without it


def test_a_read_if_match_gives_those_bytes_or_fails(root: str):
    store = storage.store_for(root)
    uri = f"{root}/blob"
    store.write_atomic(uri, b"x" * 1000)
    etag = store.get(uri).etag
    assert etag is not None and store.read(uri, 0, 10, if_match=etag) == b"x" * 10
    store.write_atomic(uri, b"y" * 1000)
    with pytest.raises(OSError):
        store.read(uri, 0, 10, if_match=etag)


def test_a_read_counts_its_requests_and_bytes(root: str):
    store = storage.store_for(root)
    uri = f"{root}/blob"
    store.write_atomic(uri, b"z" * 5000)
    stats = RequestStats()
    assert store.read(uri, 100, 1100, stats=stats) == b"z" * 1000
    with pytest.raises(FileNotFoundError):
        store.read(f"{root}/missing", 0, 10, stats=stats)
    counts = stats.counts()
    assert (counts.reads, counts.bytes, counts.retries) == (2, 1000, 0)
    assert counts.requests == 2 and len(counts.errors) == 1  # S3's NoSuchKey, FileNotFoundError here


def test_conditional_writes_hold_against_other_writers(root: str):
    store = storage.store_for(root)
    uri = f"{root}/d/_lock"
    first = store.create_if_absent(uri, b"one")
    assert first == store.get(uri).etag and store.read(uri) == b"one"
    assert store.create_if_absent(uri, b"two") is None and store.read(uri) == b"one"
    assert store.replace_if_unchanged(uri, b"three", "0" * 32) is None and store.read(uri) == b"one"
    second = store.replace_if_unchanged(uri, b"three", first)
    assert second is not None and second != first and second == store.get(uri).etag
    assert store.read(uri) == b"three"
    assert store.replace_if_unchanged(uri, b"four", first) is None  # the old ETag no longer holds
    assert not store.remove_if_unchanged(uri, first) and store.exists(uri)
    assert store.remove_if_unchanged(uri, second) and not store.exists(uri)
    assert not store.remove_if_unchanged(uri, second)
    assert store.replace_if_unchanged(uri, b"five", second) is None and not store.exists(uri)


def test_of_writers_racing_to_create_one_wins(root: str):
    store = storage.store_for(root)
    uri = f"{root}/race"
    won: list[str] = []
    start = threading.Barrier(8)

    def create(i: int) -> None:
        start.wait()
        if store.create_if_absent(uri, f"writer {i}".encode()) is not None:
            won.append(f"writer {i}")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and store.read(uri) == won[0].encode()


def test_remove_removes_a_file_or_everything_under_a_prefix(root: str):
    store = storage.store_for(root)
    for name in ("p/a", "p/q/b", "pq"):
        store.write_atomic(f"{root}/{name}", b".")
    store.remove(f"{root}/p/a")
    assert not store.exists(f"{root}/p/a") and store.exists(f"{root}/p/q/b")
    store.remove(f"{root}/p", recursive=True)
    assert not store.exists(f"{root}/p/q/b") and store.exists(f"{root}/pq")
    store.remove(f"{root}/p/never")  # nothing there: nothing to do


def test_a_rename_is_atomic_or_refused_naming_both(root: str):
    store = storage.store_for(root)
    store.write_atomic(f"{root}/src/f", b"x")
    if store.local:
        store.rename(f"{root}/src", f"{root}/dst/moved")
        assert store.read(f"{root}/dst/moved/f") == b"x" and not store.exists(f"{root}/src/f")
    else:
        with pytest.raises(StorageError, match=f"^cannot move {root}/src to {root}/dst: only local files"):
            store.rename(f"{root}/src", f"{root}/dst")
        assert store.read(f"{root}/src/f") == b"x"


def test_only_a_killed_local_writer_leaves_temporaries(root: str):
    store: Store = storage.store_for(root)
    store.write_atomic(f"{root}/kept", b"x")
    if store.local:
        stale = storage.temp_sibling(store.path(f"{root}/kept"))
        Path(stale).write_bytes(b"half")
        assert store.remove_temporaries(root) == [stale]
    assert store.remove_temporaries(root) == [] and store.read(f"{root}/kept") == b"x"
