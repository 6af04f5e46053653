"""The local cache of remote shards: what it trusts (size and sha256 from dataset.json, per
dataset version), what it keeps (a size limit), and its sharing by processes on one machine."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import boto3
import pyarrow.parquet as pq
import pytest
from loader_builders import ids_of, shard_path, write_dataset
from test_remote_reads import OPTIONS, epochs, upload

from lakeshard.errors import ConfigError
from loaders import ShardLoader
from loaders._internal.fetch import row_group_range

pytestmark = pytest.mark.s3


def one_shard(root: Path, *, version: str = "0123abcd", rows: int = 60) -> Path:
    write_dataset(
        root,
        rows={"train": rows, "validation": 4, "test": 4},
        num_shards=1,
        row_group_rows=5,
        noise=True,
        version=version,
    )
    return shard_path(root, "train", 0, 1)


def cached(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/*/*.parquet"))


def fill(remote: str, cache: Path, **options) -> ShardLoader:
    """A loader that has run epoch 0 and filled the cache."""
    loader = ShardLoader(remote, cache_dir=str(cache), **OPTIONS, **options)
    epochs(loader, [0])
    assert loader.cache.wait(timeout=60)
    return loader


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_cache_file_is_dropped_and_fetched_again(tmp_path: Path, s3_bucket: str, damage: str):
    shard = one_shard(tmp_path / "ds")
    remote = upload(tmp_path / "ds", s3_bucket)
    cache = tmp_path / "cache"
    with ShardLoader(str(tmp_path / "ds"), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1])
    fill(remote, cache).close()
    (path,) = cached(cache)
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF  # inside a row group: it would decode to a wrong image
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))

    loader = ShardLoader(remote, cache_dir=str(cache), **OPTIONS)
    assert [i for i, _ in loader.cache.dropped] == [0]
    assert epochs(loader, [0, 1]) == expected  # never decoded from the damaged file
    assert loader.cache.wait(timeout=60)
    assert loader.cache.downloaded == [0]
    loader.close()
    assert path.read_bytes() == shard.read_bytes()


def test_a_rebuilt_dataset_never_reads_the_old_versions_bytes(tmp_path: Path, s3_bucket: str):
    one_shard(tmp_path / "v1", version="1111aaaa")
    one_shard(tmp_path / "v2", version="2222bbbb", rows=50)
    cache = tmp_path / "cache"
    fill(upload(tmp_path / "v1", s3_bucket), cache).close()
    remote = upload(tmp_path / "v2", s3_bucket)  # the same URI, rebuilt
    with ShardLoader(str(tmp_path / "v2"), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1])
    loader = fill(remote, cache)
    assert loader.cache.downloaded == [0]  # its own version's copy, not the old one
    assert epochs(loader, [1]) == expected[1:]
    loader.close()
    assert sorted(p.parent.parent.name for p in cached(cache)) == ["1111aaaa", "2222bbbb"]


def test_the_least_recently_used_shards_are_evicted_beyond_the_limit(tmp_path: Path, s3_bucket: str):
    s1 = one_shard(tmp_path / "v1", version="1111aaaa")
    s2 = one_shard(tmp_path / "v2", version="2222bbbb")
    cache = tmp_path / "cache"
    limit = s1.stat().st_size + s2.stat().st_size - 1  # one shard fits, two do not
    fill(upload(tmp_path / "v1", s3_bucket, "a"), cache, cache_limit=limit).close()
    assert [p.parent.parent.name for p in cached(cache)] == ["1111aaaa"]
    fill(upload(tmp_path / "v2", s3_bucket, "b"), cache, cache_limit=limit).close()
    assert [p.parent.parent.name for p in cached(cache)] == ["2222bbbb"]
    with pytest.raises(ConfigError, match="cache_limit: a size must look like"):
        ShardLoader(str(tmp_path / "v1"), cache_limit="big")


def test_a_killed_writers_temp_file_is_never_trusted_and_is_removed(tmp_path: Path, s3_bucket: str):
    shard = one_shard(tmp_path / "ds")
    remote = upload(tmp_path / "ds", s3_bucket)
    cache = tmp_path / "cache"
    folder = cache / "0123abcd" / "train"
    folder.mkdir(parents=True)
    sha = hashlib.sha256(shard.read_bytes()).hexdigest()
    leftover = folder / f"00000-{sha}.parquet.tmp-999999-deadbeef"
    leftover.write_bytes(shard.read_bytes()[:1000])  # what a writer killed mid-write leaves
    with ShardLoader(str(tmp_path / "ds"), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1])
    loader = ShardLoader(remote, cache_dir=str(cache), **OPTIONS)
    assert loader.cache.dropped == [] and loader.cache.ready() == {}  # not taken for the shard
    assert epochs(loader, [0]) == expected[:1]
    assert loader.cache.wait(timeout=60)
    assert epochs(loader, [1]) == expected[1:]
    loader.close()
    assert not leftover.exists()
    assert [p.read_bytes() for p in cached(cache)] == [shard.read_bytes()]


_WORKER = """
import json, sys
sys.path[:0] = [sys.argv[3]]
from test_remote_reads import OPTIONS, epochs
from loaders import ShardLoader
loader = ShardLoader(sys.argv[1], cache_dir=sys.argv[2], **OPTIONS)
first = epochs(loader, [0])
loader.cache.wait(timeout=120)
later = epochs(loader, [1])
print(json.dumps({"downloaded": loader.cache.downloaded, "own_bytes": loader.cache.bytes_downloaded, "batches": first + later}))
loader.close()
"""


@pytest.mark.slow  # starts processes
def test_processes_share_one_cache_and_one_download(tmp_path: Path, s3_bucket: str):
    """Two processes, one cache folder, both through a proxy that logs what the store served:
    one process fills the cache, from its first epoch's reads (read-through): the cache itself
    asks only for what those reads leave out, the magic bytes at byte 0 among them, once; the
    streamed reads ask for row groups, which start after the magic bytes."""
    from tests.hardening.faultproxy import FaultProxy

    shard = one_shard(tmp_path / "ds", rows=200)
    remote = upload(tmp_path / "ds", s3_bucket)
    cache = tmp_path / "cache"
    with ShardLoader(str(tmp_path / "ds"), **OPTIONS) as plain:
        expected = json.loads(json.dumps(epochs(plain, [0, 1])))
    here = str(Path(__file__).parent)
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), here, os.environ.get("PYTHONPATH", "")]),
    }
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, remote, str(cache), here],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        proxy.stop()
    assert [r["batches"] for r in results] == [expected, expected]
    assert sorted(len(r["downloaded"]) for r in results) == [0, 1]  # one process downloaded, one waited
    key = f"/{remote[len('s3://') :]}/{shard.relative_to(tmp_path / 'ds').as_posix()}"
    gets = [
        r.byte_range for r in proxy.forwarded if r.method == "GET" and unquote(r.path.split("?")[0]) == key
    ]
    assert shard.stat().st_size > 1 << 16  # so no footer read (the last 64 KiB) starts at byte 0
    assert gets, proxy.forwarded
    assert [r for r in gets if r is None or r.startswith("bytes=0-")] == ["bytes=0-3"]
    # The cache itself read only what no row group holds (magic, footer): the rest came from the epoch.
    md = pq.ParquetFile(shard).metadata
    row_groups = sum(hi - lo for lo, hi in (row_group_range(md, i) for i in range(md.num_row_groups)))
    filler = next(r for r in results if r["downloaded"])
    assert 0 < filler["own_bytes"] <= shard.stat().st_size - row_groups, (filler["own_bytes"], row_groups)
    assert len(cached(cache)) == 1
    assert list(cache.rglob("*.tmp-*")) == []


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def mounted(target: Path, *, source: Path | None = None, tmpfs: str | None = None) -> Iterator[Path]:
    """A real mount at ``target``: ``source`` bound there read-only, or a tmpfs with ``tmpfs``
    options (``"ro"``, ``"size=64k"``): folders that not even root can write. Unmounted at the
    end; skips the test if this machine cannot mount (no CAP_SYS_ADMIN)."""
    target.mkdir(parents=True, exist_ok=True)
    if source is not None:
        steps = [
            ["mount", "--bind", str(source), str(target)],
            ["mount", "-o", "remount,bind,ro", str(target)],
        ]
    else:
        steps = [["mount", "-t", "tmpfs", "-o", str(tmpfs), "lakeshard-test", str(target)]]
    done = 0
    try:
        for step in steps:
            result = _run(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot mount here ({' '.join(step)}: {result.stderr.strip()})")
            done += 1
        yield target
    finally:
        if done and _run("umount", str(target)).returncode != 0:
            _run("umount", "-l", str(target))  # a file still open in it: detach it anyway


def two_shards(tmp_path: Path, s3_bucket: str) -> tuple[Path, str, list]:
    """A 2-shard dataset of about 100 KiB per shard, uploaded; its batches of epochs 0 and 1."""
    local = tmp_path / "ds"
    write_dataset(local, rows={"train": 120, "validation": 4, "test": 4}, num_shards=2, size=32, noise=True)
    with ShardLoader(str(local), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1])
    return local, upload(local, s3_bucket), expected


def cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = caplog.records
    return [
        r.getMessage()
        for r in records
        if r.name == "loaders._internal.cache" and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("held", [0, 1, 2])
def test_a_read_only_cache_dir_serves_the_shards_it_holds_and_the_rest_remotely(
    tmp_path: Path, s3_bucket: str, caplog: pytest.LogCaptureFixture, held: int
):
    """A cache folder on a read-only mount (filled earlier, or empty): its verified shards are
    read from it, untouched; the others are read remotely every epoch, with one WARNING naming
    the folder and why; the batches are those of a local read."""
    local, remote, expected = two_shards(tmp_path, s3_bucket)
    cache = tmp_path / "cache"
    if held:
        fill(remote, cache).close()
        for path in cached(cache)[held:]:
            path.unlink()
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in cached(cache)}
    source = {"source": cache} if held else {"tmpfs": "ro,size=1m"}  # empty: not even its subfolders
    with mounted(tmp_path / "ro", **source) as ro:
        caplog.set_level(logging.INFO, logger="loaders._internal.cache")
        loader = ShardLoader(remote, cache_dir=str(ro), **OPTIONS)
        try:
            assert sorted(loader.cache.ready()) == list(range(held))
            assert loader.cache.read_only == "Read-only file system"
            # The store loses the shards the cache holds: they must come from the cache (the
            # constructor has read every footer already).
            client, bucket = boto3.client("s3"), s3_bucket[len("s3://") :]
            for i in range(held):
                key = f"ds/{shard_path(local, 'train', i, 2).relative_to(local).as_posix()}"
                client.head_object(Bucket=bucket, Key=key)  # there until now
                client.delete_object(Bucket=bucket, Key=key)
            assert epochs(loader, [0, 1]) == expected
            assert loader.cache.wait(timeout=60)
            assert (loader.cache.downloaded, loader.cache.errors, loader.cache.dropped) == ([], [], [])
        finally:
            loader.close()
        warnings = cache_warnings(caplog)
        if held == 2:
            assert warnings == []  # nothing is missing: a read-only cache that holds it all is fine
        else:
            assert warnings == [
                f"cache_dir {ro} cannot be written (Read-only file system): {held} of 2 shards of channel "
                f"'train' are read from it, the other {2 - held} remotely, every epoch"
            ]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in cached(cache)} == before  # not even touched


def test_a_full_cache_disk_is_used_as_a_read_only_one(
    tmp_path: Path, s3_bucket: str, caplog: pytest.LogCaptureFixture
):
    """A cache folder whose disk fills up (a 64 KiB tmpfs, smaller than a shard) is treated as one
    that cannot be written: one WARNING, no more downloads, no temp file left, the shards read
    remotely, the batches unchanged."""
    _, remote, expected = two_shards(tmp_path, s3_bucket)
    with mounted(tmp_path / "small", tmpfs="size=64k") as small:
        caplog.set_level(logging.INFO, logger="loaders._internal.cache")
        loader = ShardLoader(remote, cache_dir=str(small), **OPTIONS)
        try:
            assert epochs(loader, [0]) == expected[:1]
            assert loader.cache.wait(timeout=60)
            assert loader.cache.read_only == "No space left on device"
            assert epochs(loader, [1]) == expected[1:]  # no second try, no second warning
            assert loader.cache.downloaded == [] and loader.cache.ready() == {}
        finally:
            loader.close()
        assert cache_warnings(caplog) == [
            f"cache_dir {small} cannot be written (No space left on device): 0 of 2 shards of channel "
            f"'train' are read from it, the other 2 remotely, every epoch"
        ]
        assert list(small.rglob("*.tmp-*")) == [] and list(small.rglob("*.parquet")) == []


def _row_group_bytes(shard: Path) -> int:
    md = pq.ParquetFile(shard).metadata
    return sum(hi - lo for lo, hi in (row_group_range(md, i) for i in range(md.num_row_groups)))


def test_the_first_epoch_fills_the_cache_from_its_own_reads(tmp_path: Path, s3_bucket: str):
    """Read-through: the cache downloads only what no row group holds; the row groups come from
    the epoch's reads, so epoch 1 reads each byte of the shard once."""
    shard = one_shard(tmp_path / "ds")
    remote = upload(tmp_path / "ds", s3_bucket)
    with ShardLoader(str(tmp_path / "ds"), **OPTIONS) as plain:
        expected = epochs(plain, [0, 1])
    loader = fill(remote, tmp_path / "cache")
    own, size = loader.cache.bytes_downloaded, shard.stat().st_size
    assert 0 < own <= size - _row_group_bytes(shard) and loader.cache.bytes_offered >= _row_group_bytes(shard)
    assert loader.cache.downloaded == [0] and [p.read_bytes() for p in cached(tmp_path / "cache")] == [
        shard.read_bytes()
    ]
    assert epochs(loader, [1]) == expected[1:]
    loader.close()


def test_an_epoch_resumed_midway_fills_the_rest_when_it_ends(tmp_path: Path, s3_bucket: str):
    """A resumed epoch reads only its remaining windows: when it ends, the cache downloads the
    row groups it did not read, and the file is whole."""
    shard = one_shard(tmp_path / "ds")
    remote = upload(tmp_path / "ds", s3_bucket)
    with ShardLoader(str(tmp_path / "ds"), **OPTIONS) as plain:
        expected = epochs(plain, [0])
        plain.set_epoch(0)
        it = iter(plain)
        for _ in range(4):
            next(it)
        state = plain.state_dict()
    loader = ShardLoader(remote, cache_dir=str(tmp_path / "cache"), **OPTIONS)
    loader.load_state_dict(state)
    rest = [(ids_of(images), labels.tolist()) for images, labels in loader]
    assert rest == expected[0][4:]
    assert loader.cache.wait(timeout=60)
    assert loader.cache.downloaded == [0]
    assert loader.cache.bytes_downloaded > shard.stat().st_size - _row_group_bytes(shard)  # row groups too
    assert [p.read_bytes() for p in cached(tmp_path / "cache")] == [shard.read_bytes()]
    loader.close()


@pytest.mark.parametrize("seed", range(20))
def test_gaps_are_what_the_ranges_held_leave_out(seed: int):
    import random

    from loaders._internal.cache import _gaps, _merge

    rng = random.Random(seed)
    want = [(a, a + rng.randint(0, 30)) for a in (rng.randint(0, 100) for _ in range(rng.randint(0, 4)))]
    have = [(a, a + rng.randint(0, 30)) for a in (rng.randint(0, 100) for _ in range(rng.randint(0, 6)))]
    gaps = _gaps(want, have)
    wanted = {i for lo, hi in want for i in range(lo, hi)}
    held = {i for lo, hi in have for i in range(lo, hi)}
    assert {i for lo, hi in gaps for i in range(lo, hi)} == wanted - held
    assert gaps == _merge(gaps)  # sorted, disjoint, nothing empty
