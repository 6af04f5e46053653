"""The local cache of remote shards: what it trusts (size and sha256 from dataset.json, per
dataset version), what it keeps (a size limit), and its sharing by processes on one machine."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from loader_builders import shard_path, write_dataset
from test_remote_reads import OPTIONS, epochs, upload

from lakeshard.errors import ConfigError
from loaders import ShardLoader

pytestmark = pytest.mark.s3


def one_shard(root: Path, *, version: str = "0123abcd", rows: int = 60) -> Path:
    write_dataset(root, rows={"train": rows, "validation": 4, "test": 4}, num_shards=1, row_group_rows=5,
                  noise=True, version=version)  # fmt: skip
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
print(json.dumps({"downloaded": loader.cache.downloaded, "batches": first + later}))
loader.close()
"""


def test_processes_share_one_cache_and_one_download(tmp_path: Path, s3_bucket: str):
    """Two processes, one cache folder, both through a proxy that logs what the store served:
    the store sends the shard whole once (the cache's download starts at byte 0; the streamed
    reads of the first epoch ask for row groups, which start after the magic bytes)."""
    from tests.hardening.faultproxy import FaultProxy

    shard = one_shard(tmp_path / "ds", rows=200)
    remote = upload(tmp_path / "ds", s3_bucket)
    cache = tmp_path / "cache"
    with ShardLoader(str(tmp_path / "ds"), **OPTIONS) as plain:
        expected = json.loads(json.dumps(epochs(plain, [0, 1])))
    here = str(Path(__file__).parent)
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint,
           "PYTHONPATH": os.pathsep.join([os.getcwd(), here, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, remote, str(cache), here], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        proxy.stop()
    assert [r["batches"] for r in results] == [expected, expected]
    assert sorted(len(r["downloaded"]) for r in results) == [0, 1]  # one process downloaded, one waited
    key = f"/{remote[len('s3://'):]}/{shard.relative_to(tmp_path / 'ds').as_posix()}"
    gets = [r.byte_range for r in proxy.forwarded if r.method == "GET" and unquote(r.path.split("?")[0]) == key]
    assert shard.stat().st_size > 1 << 16  # so no footer read (the last 64 KiB) starts at byte 0
    assert gets, proxy.forwarded
    assert [r for r in gets if r is None or r.startswith("bytes=0-")] == [f"bytes=0-{shard.stat().st_size - 1}"]
    assert len(cached(cache)) == 1
    assert list(cache.rglob("*.tmp-*")) == []
