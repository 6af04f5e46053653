"""Remote shards (S3, the moto server of tests/conftest.py): row groups read concurrently within a
memory budget, the same batches as a local read, and the local cache (verified, keyed by
dataset version, evicted, shared by processes, safe against a killed writer)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import boto3
import pytest
from loader_builders import ids_of, shard_path, until, write_dataset

from lakeshard.errors import ConfigError, LoaderError
from lakeshard.storage import S3Store
from loaders import ShardLoader
from tests.helpers.store import upload

#: The store the fetch threads read S3 through.
S3 = S3Store()

pytestmark = pytest.mark.s3

OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 5, "shuffle_window": 40, "num_threads": 2}


def delete_all(bucket: str) -> None:
    client = boto3.client("s3")
    name = bucket[len("s3://") :]
    for obj in client.list_objects_v2(Bucket=name).get("Contents", []):
        client.delete_object(Bucket=name, Key=obj["Key"])


def epochs(loader: ShardLoader, which: list[int]) -> list[list[tuple[list[int], list[int]]]]:
    out = []
    for e in which:
        loader.set_epoch(e)
        out.append([(ids_of(images), labels.tolist()) for images, labels in loader])
    return out


@pytest.fixture
def local_ds(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    write_dataset(
        root, rows={"train": 120, "validation": 8, "test": 8}, num_shards=2, row_group_rows=5, noise=True
    )
    return root


@pytest.mark.slow
def test_remote_batches_are_the_local_ones_whatever_the_concurrency(local_ds: Path, s3_bucket: str):
    remote = upload(local_ds, s3_bucket)
    with ShardLoader(str(local_ds), **OPTIONS) as local:
        expected = epochs(local, [0, 1, 2])
    for concurrency in (1, 8):
        with ShardLoader(remote, read_concurrency=concurrency, **OPTIONS) as loader:
            assert epochs(loader, [0, 1, 2]) == expected
            assert loader.fetcher is not None and loader.fetcher.bytes_read > 0
    for rank in (0, 1):  # each rank its own share, also remotely
        opts = {**OPTIONS, "world_size": 2, "rank": rank}
        with ShardLoader(str(local_ds), **opts) as local, ShardLoader(remote, **opts) as loader:
            assert epochs(loader, [3]) == epochs(local, [3])


@pytest.mark.slow
def test_bytes_held_stay_within_the_memory_budget(tmp_path: Path, s3_bucket: str):
    local = tmp_path / "ds"
    write_dataset(
        local, rows={"train": 400, "validation": 4, "test": 4}, num_shards=1, row_group_rows=4, noise=True
    )
    remote = upload(local, s3_bucket)
    shard_bytes = shard_path(local, "train", 0, 1).stat().st_size
    probe = ShardLoader(remote, **OPTIONS)
    largest, decoded = probe.reader.ranges.max_range_bytes(), None
    probe.close()
    # The decoded batches: (num_threads + prefetch + 3) blocks of batch_size 8x8 RGB uint8 images.
    decoded = (2 + 4 + 3) * 8 * 3 * 8 * 8
    budget = decoded + 3 * largest
    assert 3 * largest < shard_bytes / 10  # the shard is far larger than the reads may hold
    with ShardLoader(remote, read_concurrency=16, memory_budget=budget, **OPTIONS) as loader:
        assert loader.fetcher.budget == 3 * largest
        got = epochs(loader, [0, 1])
        assert 0 < loader.peak_bytes_held <= 3 * largest
        assert loader.fetcher.bytes_read > 10 * loader.fetcher.budget  # streamed through, never all held
    with ShardLoader(str(local), **OPTIONS) as plain:
        assert got == epochs(plain, [0, 1])
    with pytest.raises(ConfigError, match=r"memory_budget 1000 bytes is too small"):
        ShardLoader(remote, memory_budget="1000", **OPTIONS)
    with pytest.raises(ConfigError, match=r"memory_budget: a size must look like"):
        ShardLoader(remote, memory_budget="lots", **OPTIONS)


def cached_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/*/*.parquet"))


def test_the_cache_serves_later_epochs_without_the_store(local_ds: Path, s3_bucket: str, tmp_path: Path):
    remote = upload(local_ds, s3_bucket)
    cache = tmp_path / "cache"
    with ShardLoader(str(local_ds), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1, 2])
    loader = ShardLoader(remote, cache_dir=str(cache), **OPTIONS)
    assert epochs(loader, [0]) == expected[:1]  # the first epoch streams while the cache fills
    assert loader.cache.wait(timeout=60)
    assert sorted(loader.cache.downloaded) == [0, 1]  # one rank: both shards
    delete_all(s3_bucket)  # nothing remote from now on
    assert epochs(loader, [1, 2]) == expected[1:]
    loader.close()
    files = cached_files(cache)
    assert [f.parent.parent.name for f in files] == ["0123abcd"] * len(files)  # keyed by dataset version
    for f in files:
        index = int(f.name.split("-")[0])
        assert f.read_bytes() == shard_path(local_ds, "train", index, 2).read_bytes()


def test_a_local_dataset_is_never_copied(local_ds: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    with ShardLoader(str(local_ds), cache_dir=str(cache), **OPTIONS) as loader:
        epochs(loader, [0])
        assert loader.cache is None
    assert not cache.exists() or cached_files(cache) == []


def test_an_object_replaced_mid_run_is_refused_not_decoded(tmp_path: Path, s3_bucket: str):
    """Footers are read once per loader; every ranged read asks for the object the loader checked
    (its ETag), so a shard rebuilt at the same key fails the read instead of decoding other bytes."""
    write_dataset(
        tmp_path / "a",
        rows={"train": 40, "validation": 4, "test": 4},
        num_shards=1,
        row_group_rows=5,
        noise=True,
    )
    # Rebuilt with the same rows: the same row-group offsets, another footer (another version).
    write_dataset(
        tmp_path / "b",
        rows={"train": 40, "validation": 4, "test": 4},
        num_shards=1,
        row_group_rows=5,
        noise=True,
        version="89abcdef",
    )
    remote = upload(tmp_path / "a", s3_bucket)
    loader = ShardLoader(remote, **OPTIONS)
    epochs(loader, [0])
    shard = shard_path(tmp_path / "b", "train", 0, 1)
    boto3.client("s3").put_object(
        Bucket=s3_bucket[len("s3://") :],
        Key=f"ds/{shard.relative_to(tmp_path / 'b').as_posix()}",
        Body=shard.read_bytes(),
    )
    with pytest.raises(LoaderError, match=r"cannot read row group \d+ .*part-00000-of-00001.parquet"):
        epochs(loader, [1, 2])  # (epoch 1's window may have been read ahead, from the old object)
    loader.close()


@pytest.mark.slow
def test_reads_in_flight_ride_out_transient_store_faults(
    local_ds: Path, s3_bucket: str, monkeypatch, tmp_path: Path
):
    """A proxy answers a seeded 10% of requests with 500, 503 SlowDown or a dropped connection:
    with 8 reads in flight and the cache filling, the batches are still the local ones."""
    from tests.hardening.faultproxy import FaultProxy

    remote = upload(local_ds, s3_bucket)
    with ShardLoader(str(local_ds), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1])
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.reset(mode="faults", rate=0.1, seed=2)
        with ShardLoader(remote, read_concurrency=8, cache_dir=str(tmp_path / "cache"), **OPTIONS) as loader:
            assert epochs(loader, [0]) == expected[:1]
            assert loader.cache.wait(timeout=120)
            assert epochs(loader, [1]) == expected[1:]
        assert sum(proxy.injected.values()) > 0, proxy.injected
    finally:
        proxy.stop()


def test_the_next_epoch_is_fetched_in_its_order_while_this_one_ends(local_ds: Path, s3_bucket: str):
    """In a ``set_epoch(e); for batch in loader`` loop, when the last batch of epoch e reaches the
    training loop, the reads of epoch e + 1 are issued in its order (its first batch's at least);
    with ``read_concurrency`` above the rank's row groups, every row group of epoch e + 1 is read
    before it starts, and epoch e + 1 uses them (each fetched once). That a boundary never waits
    on the store: ``test_an_epoch_boundary_never_waits_on_the_store``."""
    remote = upload(local_ds, s3_bucket)
    with ShardLoader(str(local_ds), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1, 2])
    with ShardLoader(remote, read_concurrency=32, memory_budget="1GiB", **OPTIONS) as loader:
        assert epochs(loader, [0]) == expected[:1]
        fetcher = loader.fetcher
        pieces = len(loader.plan(0).pieces)
        for epoch in (1, 2):
            loader.set_epoch(epoch)
            following = loader.plan(epoch + 1).order
            # The windows its first batch needs:
            first_batch = following.window_at(OPTIONS["batch_size"] - 1) + 1
            in_order = [int(p) for w in following.windows for p in w]
            got = []
            for i, (images, labels) in enumerate(loader):
                got.append((ids_of(images), labels.tolist()))
                if i == len(loader) - 1:  # the last batch of this epoch, in the training loop
                    issued_next = [k[-1] for k in fetcher.submitted if k[0] == epoch + 1]
                    until(
                        lambda e=epoch: sum(k[0] == e + 1 for k in fetcher.completed) == pieces,
                        f"every row group of epoch {epoch + 1} is read",
                    )
            assert got == expected[epoch]
            assert issued_next == in_order[: len(issued_next)] and len(issued_next) >= sum(
                map(len, following.windows[:first_batch])
            )
        of_2 = [k for k in fetcher.submitted if k[0] == 2]
        assert len(of_2) == len(set(of_2)) == pieces  # each fetched once: epoch 2 used its read-ahead
        assert fetcher.peak_bytes_held <= fetcher.budget


@pytest.mark.slow
def test_an_epoch_boundary_never_waits_on_the_store(local_ds: Path, s3_bucket: str, monkeypatch):
    """Through a store that stops answering (a proxy holding requests, counted at the proxy):
    epoch 0 runs to its end while every read of epoch 1 is held unanswered, and epoch 1's first
    batch comes while the store answers nothing at all: it was read during epoch 0."""
    from tests.hardening.faultproxy import FaultProxy

    remote = upload(local_ds, s3_bucket)
    with ShardLoader(str(local_ds), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1])
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    proxy.hold_s = 20.0
    stack = contextlib.ExitStack()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        # One read at a time: every read of epoch 0 reaches the store before any of epoch 1.
        loader = ShardLoader(remote, read_concurrency=1, memory_budget="1GiB", **OPTIONS)
        stack.callback(loader.close)
        # Epoch 0 reads each row group once; epoch 1's reads are repeats: the store holds them.
        proxy.stall_requests("repeats")
        loader.set_epoch(0)
        got = []
        for i, (images, labels) in enumerate(loader):
            got.append((ids_of(images), labels.tolist()))
            if i == len(loader) - 1:
                until(lambda: proxy.stalled > 0, "the store holds epoch 1's first reads")
        assert proxy.stalled > 0 and proxy.timed_out == 0  # the epoch ended with them still held
        assert got == expected[0]

        proxy.unstall()
        fetcher = loader.fetcher
        until(
            lambda: {k for k in fetcher.submitted if k[0] == 1} <= set(fetcher.completed),
            "epoch 1's first reads are in",
        )
        proxy.stall_requests("all")
        loader.set_epoch(1)
        batches = iter(loader)
        images, labels = next(batches)
        assert proxy.timed_out == 0  # no held request was needed for it
        got = [(ids_of(images), labels.tolist())]
        proxy.unstall()
        got += [(ids_of(images), labels.tolist()) for images, labels in batches]
        assert got == expected[1]
    finally:
        proxy.unstall()
        stack.close()
        proxy.stop()


@pytest.mark.slow
def test_a_new_loader_reads_its_shards_footers_at_once(tmp_path: Path, s3_bucket: str, monkeypatch):
    """A rank of several remote shards opens them concurrently: with the store holding every
    request for a while, all four shards' first requests are held at the same time."""
    from tests.hardening.faultproxy import FaultProxy

    write_dataset(
        tmp_path / "ds", rows={"train": 40, "validation": 4, "test": 4}, num_shards=4, row_group_rows=5
    )
    remote = upload(tmp_path / "ds", s3_bucket)
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.hold_s = 1.0
        proxy.stall_requests("all")
        with ShardLoader(remote, **OPTIONS) as loader:
            assert len(loader.shard_uris) == 4
        assert proxy.timed_out > 0 and proxy.most_stalled == 4
    finally:
        proxy.unstall()
        proxy.stop()


def test_a_new_loader_opens_each_remote_shard_with_one_get_and_no_head(
    local_ds: Path, s3_bucket: str, monkeypatch
):
    """A fresh loader reads a remote shard's footer with one suffix-range GET (whose answer
    carries the size and ETag): no HEAD of a shard, at its opening or after (requests counted at
    a proxy in front of the store)."""
    from tests.hardening.faultproxy import FaultProxy

    remote = upload(local_ds, s3_bucket)
    with ShardLoader(str(local_ds), **OPTIONS) as plain:
        expected = epochs(plain, [0])
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.reset(mode="pass")
        with ShardLoader(remote, **OPTIONS) as loader:
            opening = [
                (r.method, r.path.split("?")[0].rsplit("/", 1)[-1], r.byte_range)
                for r in proxy.log
                if ".parquet" in r.path
            ]
            assert epochs(loader, [0]) == expected
        shard_requests = [r for r in proxy.log if ".parquet" in r.path]
    finally:
        proxy.stop()
    assert sorted(opening) == [
        ("GET", "part-00000-of-00002.parquet", "bytes=-262144"),
        ("GET", "part-00001-of-00002.parquet", "bytes=-262144"),
    ]
    assert len(shard_requests) > len(opening)  # the row groups came through the proxy too
    assert [r for r in shard_requests if r.method != "GET"] == []


def test_a_row_group_is_one_get_unless_it_spans_two_parts(s3_bucket: str, monkeypatch):
    """A row group of less than twice the part size is read in one GET (not a full part and a
    sliver); a larger one in equal parts at once; the bytes are the object's either way."""
    from loaders._internal.fetch import _PART_BYTES, ByteRange, read_range
    from tests.hardening.faultproxy import FaultProxy

    data = os.urandom(2 * _PART_BYTES + 100_000)
    boto3.client("s3").put_object(Bucket=s3_bucket[len("s3://") :], Key="blob", Body=data)
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        got = {}
        for size in (_PART_BYTES - 10, _PART_BYTES + 20_000, 2 * _PART_BYTES - 1, 2 * _PART_BYTES + 99_000):
            proxy.reset(mode="pass")
            assert read_range(S3, ByteRange(f"{s3_bucket}/blob", 50, 50 + size)) == data[50 : 50 + size]
            got[size] = sorted(r.byte_range for r in proxy.log if r.method == "GET")
    finally:
        proxy.stop()
    half = _PART_BYTES + 49_500
    assert got == {
        _PART_BYTES - 10: [f"bytes=50-{50 + _PART_BYTES - 11}"],
        _PART_BYTES + 20_000: [f"bytes=50-{50 + _PART_BYTES + 19_999}"],
        2 * _PART_BYTES - 1: [f"bytes=50-{50 + 2 * _PART_BYTES - 2}"],
        2 * _PART_BYTES + 99_000: sorted(
            [f"bytes=50-{50 + half - 1}", f"bytes={50 + half}-{50 + 2 * half - 1}"]
        ),
    }


def test_a_read_a_batch_waits_on_is_fetched_in_parts_of_at_least_1_mib(s3_bucket: str, monkeypatch):
    """``ByteRange.parts``: that many equal parts at once, but none under 1 MiB (and never
    fewer than the part size makes); the bytes are the object's."""
    from loaders._internal.fetch import ByteRange, read_range
    from tests.hardening.faultproxy import FaultProxy

    mib = 1 << 20
    data = os.urandom(5 * mib)
    boto3.client("s3").put_object(Bucket=s3_bucket[len("s3://") :], Key="blob", Body=data)
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        got = {}
        for size, parts in ((mib - 1, 8), (2 * mib + 10, 8), (4 * mib, 3), (4 * mib, 1)):
            proxy.reset(mode="pass")
            r = ByteRange(f"{s3_bucket}/blob", 10, 10 + size, parts=parts)
            assert read_range(S3, r) == data[10 : 10 + size]
            got[size, parts] = len([r for r in proxy.log if r.method == "GET"])
    finally:
        proxy.stop()
    assert got == {(mib - 1, 8): 1, (2 * mib + 10, 8): 2, (4 * mib, 3): 3, (4 * mib, 1): 1}


@pytest.mark.slow  # retries with backoff through ~120 injected faults
def test_a_range_read_rides_out_every_kind_of_transient_store_fault(s3_bucket: str, monkeypatch):
    """The fetch threads' blocking client (``S3Store.read``) through a proxy that answers
    a seeded 30% of requests with 500, 503 SlowDown, a dropped connection or a body cut off
    halfway: every read still returns the object's bytes, whole parts and a read in parts alike,
    and each kind of fault was met. The client follows ``AWS_ENDPOINT_URL`` (the proxy saw the
    reads) and is one per process and setting, until forgotten."""
    from lakeshard import storage
    from loaders._internal.fetch import ByteRange, read_range
    from tests.hardening.faultproxy import FaultProxy

    mib = 1 << 20
    data = os.urandom(3 * mib)
    bucket = s3_bucket[len("s3://") :]
    boto3.client("s3").put_object(Bucket=bucket, Key="blob", Body=data)
    before = storage.s3_client()
    storage.clear_s3_clients()  # as a new process has none
    direct = storage.s3_client()
    assert direct is not before and storage.s3_client() is direct
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        assert storage.s3_client() is not direct
        proxy.reset(mode="faults", rate=0.3, seed=4)
        for i in range(40):
            start = i * 50_000
            assert (
                read_range(S3, ByteRange(f"s3://{bucket}/blob", start, start + 200_000))
                == data[start : start + 200_000]
            )
        assert read_range(S3, ByteRange(f"s3://{bucket}/blob", 7, 3 * mib, parts=3)) == data[7:]
    finally:
        proxy.stop()
    assert {"500", "503", "drop", "cut"} <= set(proxy.injected), proxy.injected
    assert len([r for r in proxy.log if r.method == "GET"]) > 40


def test_a_range_read_s_store_errors_are_the_usual_python_ones(s3_bucket: str, tmp_path: Path, monkeypatch):
    """A missing object is ``FileNotFoundError``, a denied one ``PermissionError``, a changed one
    (``If-Match`` an old ETag) an ``OSError`` from the store's 412, none retried for long."""
    from loaders._internal.fetch import ByteRange, read_range
    from tests.hardening.faultproxy import FaultProxy

    bucket = s3_bucket[len("s3://") :]
    etag = boto3.client("s3").put_object(Bucket=bucket, Key="blob", Body=b"x" * 1000)["ETag"].strip('"')
    assert read_range(S3, ByteRange(f"s3://{bucket}/blob", 0, 10, etag=etag)) == b"x" * 10
    with pytest.raises(FileNotFoundError):
        read_range(S3, ByteRange(f"s3://{bucket}/no-such-blob", 0, 10))
    boto3.client("s3").put_object(Bucket=bucket, Key="blob", Body=b"y" * 1000)
    with pytest.raises(OSError, match="pre-conditions"):
        read_range(S3, ByteRange(f"s3://{bucket}/blob", 0, 10, etag=etag))
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.reset(mode="deny")
        started = time.monotonic()
        with pytest.raises(PermissionError):
            read_range(S3, ByteRange(f"s3://{bucket}/blob", 0, 10))
        assert time.monotonic() - started < 10
        assert proxy.injected["403"] == 1
    finally:
        proxy.stop()


def test_the_first_batch_s_row_groups_are_asked_for_in_parts(local_ds: Path, s3_bucket: str):
    """When an epoch starts, the reads of its first batch carry ``parts=read_concurrency``, the
    others one; read ahead (no batch waits on them yet), every read is one part."""
    remote = upload(local_ds, s3_bucket)
    with ShardLoader(remote, read_concurrency=5, **OPTIONS) as loader:
        reader = loader.reader
        plan = reader.plan(0)
        starting = reader.ranges.keys(0, plan, range(len(plan.order.windows)), waited_from=0)
        ahead = reader.ranges.keys(0, plan, range(len(plan.order.windows)))
    first = sum(map(len, plan.order.windows[: plan.order.window_at(OPTIONS["batch_size"] - 1) + 1]))
    assert [r.parts for _, r in starting] == [5] * first + [1] * (len(starting) - first)
    assert 0 < first < len(starting) and {r.parts for _, r in ahead} == {1}


def test_a_resumed_epoch_s_first_batch_is_asked_for_in_parts(local_ds: Path, s3_bucket: str):
    """An epoch resumed mid-way (a restored state) waits on the row groups of the batch it
    resumes at: those carry the parts, not the ones of the epoch's first batch, which it skips."""
    remote = upload(local_ds, s3_bucket)
    bs = OPTIONS["batch_size"]
    with ShardLoader(remote, read_concurrency=5, **OPTIONS) as loader:
        reader = loader.reader
        plan = reader.plan(0)
        windows = plan.order.windows
        # A batch that starts past the first batch's windows, inside a window of its own.
        at = next(
            b * bs
            for b in range(1, plan.end // bs)
            if plan.order.window_at(b * bs) > plan.order.window_at(bs - 1)
            and plan.order.window_at(b * bs) == plan.order.window_at(b * bs + bs - 1)
        )
        w = plan.order.window_at(at)
        resumed = reader.ranges.keys(0, plan, range(w, len(windows)), waited_from=at)
    assert [r.parts for _, r in resumed] == [5] * len(windows[w]) + [1] * sum(map(len, windows[w + 1 :]))
    assert sum(map(len, windows[w + 1 :])) > 0


def test_the_next_epoch_is_read_ahead_by_one_round_of_reads(local_ds: Path, s3_bucket: str):
    """Before epoch e + 1 starts, exactly its first ``max(first batch's, read_concurrency)``
    row groups are read ahead, in its order (more than its first batch's); the rest when it
    starts."""
    remote = upload(local_ds, s3_bucket)
    with ShardLoader(str(local_ds), **OPTIONS) as plain:
        pieces = len(plain.plan(0).pieces)
        following = plain.plan(1).order
    first_batch = sum(map(len, following.windows[: following.window_at(OPTIONS["batch_size"] - 1) + 1]))
    concurrency = first_batch + 2
    assert concurrency < pieces  # the dataset has more row groups than one round
    with ShardLoader(remote, read_concurrency=concurrency, **OPTIONS) as loader:
        epochs(loader, [0])
        fetcher = loader.fetcher
        until(
            lambda: sum(k[0] == 1 for k in fetcher.completed) >= concurrency,
            "epoch 1's first row groups are read",
        )
        # Nothing more is read until epoch 1 starts: once every read submitted has ended, the
        # fetcher has admitted whatever it would (it does so as each read ends, under its lock).
        until(lambda: fetcher.reads_ended(), "the fetcher has no read under way")
        issued = [k[-1] for k in fetcher.submitted if k[0] == 1]
    assert issued == [int(p) for w in following.windows for p in w][:concurrency]


def test_in_a_loop_the_next_epoch_asks_for_all_its_reads_before_it_is_iterated(
    local_ds: Path, s3_bucket: str
):
    """Once the loop has made a step of one epoch, the epochs are one stream: when epoch e's
    reads are done, the reader walks on into epoch e + 1 and asks for every one of its row
    groups, before the loop starts it."""
    remote = upload(local_ds, s3_bucket)
    with ShardLoader(remote, read_concurrency=16, prefetch=2, **OPTIONS) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            list(loader)
        fetcher, pieces = loader.fetcher, len(loader.plan(0).pieces)
        until(
            lambda: len({k for k in fetcher.submitted if k[0] == 2}) == pieces,
            "every read of epoch 2 is asked for",
        )


def test_the_fetch_and_part_threads_are_started_with_the_loader_and_kept(local_ds: Path, s3_bucket: str):
    """A remote loader starts its ``read_concurrency`` fetch threads and as many part threads
    in its constructor (not one by one behind the first batch's reads); its epochs use those,
    and ``close`` stops them."""
    import threading

    def fetching() -> set[threading.Thread]:
        return {
            t for t in threading.enumerate() if t.name.startswith(("lakeshard-r0-fetch", "lakeshard-r0-part"))
        }

    remote = upload(local_ds, s3_bucket)
    with ShardLoader(remote, read_concurrency=3, **OPTIONS) as loader:
        started = fetching()
        assert sorted(t.name for t in started) == [
            f"lakeshard-r0-{kind}_{i}" for kind in ("fetch", "part") for i in range(3)
        ]
        assert epochs(loader, [0, 1]) and fetching() == started  # a first batch in parts: the same threads
        assert loader.fetcher.bytes_read > 0
    assert fetching() == set()


@pytest.mark.slow
def test_a_remote_loader_reads_through_one_client_without_s3fs(local_ds: Path, s3_bucket: str):
    """A new process that streams an ``s3://`` dataset (``dataset.json``, footers, row groups)
    makes one S3 client, the blocking one: it never imports s3fs or aiobotocore and runs no
    event-loop thread (a second client stack costs a new process ~0.3 s before its first batch)."""
    import subprocess
    import sys

    remote = upload(local_ds, s3_bucket)
    child = (
        "import json, sys, threading\n"
        "from loaders import ShardLoader\n"
        f"with ShardLoader({remote!r}, batch_size=8, num_threads=1) as loader:\n"
        "    batches = sum(1 for _ in loader)\n"
        "print(json.dumps({'batches': batches, 'modules': sorted(m for m in ('s3fs', 'aiobotocore', 'aiohttp') if m in sys.modules),\n"
        "                  'threads': sorted(t.name for t in threading.enumerate())}))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
        cwd=root,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["batches"] == 15  # 120 rows in batches of 8: the dataset was read
    assert got["modules"] == [] and got["threads"] == ["MainThread"], got
