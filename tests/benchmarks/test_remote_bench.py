"""The remote-like store (benchmarks/remote_store.py) serves what s3fs and the loader ask for,
counts it, and leaves no process behind; remote_bench.py runs end to end on a tiny dataset.
(Its figures are measured by hand; no test asserts a speed.)"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _timing import procs_cpu_s  # noqa: E402 - benchmarks/ is not a package
from loader_bench import build_dataset  # noqa: E402
from remote_store import NginxMissingError, RemoteStore, find_nginx, parse_rate  # noqa: E402

from lakeshard.format import shard_relpath  # noqa: E402
from loaders import ShardLoader  # noqa: E402


@pytest.fixture(scope="module")
def nginx() -> str:
    """nginx must be installed: a missing one fails (with how to install it), never skips."""
    try:
        return find_nginx()
    except NginxMissingError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one tiny dataset, ``bench-ds`` (40 images, 32px, two row groups' worth
    of nothing: one shard per channel)."""
    root = tmp_path_factory.mktemp("lake")
    build_dataset(root / "bench-ds", images=40, size=32, quality=90)
    return root


@pytest.fixture()
def store(nginx: str, lake: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteStore]:
    with RemoteStore(lake, latency_ms=2, bandwidth=50_000_000) as running:
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        for key, value in running.environ().items():
            monkeypatch.setenv(key, value)
        yield running


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def epoch_batches(loader: ShardLoader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader]


def read_columns_bytes(shard: Path, columns: list[str]) -> int:
    """The bytes of ``columns``' chunks in ``shard`` (what a reader of those columns must fetch)."""
    meta = pq.ParquetFile(shard).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    return sum(
        meta.row_group(g).column(names.index(c)).total_compressed_size
        for g in range(meta.num_row_groups)
        for c in columns
    )


def test_the_loader_reads_the_same_batches_from_the_store_as_from_disk(store: RemoteStore, lake: Path):
    local = ShardLoader(str(lake / "bench-ds"), batch_size=16, shuffle=True, seed=3)
    remote = ShardLoader(store.uri("bench-ds"), batch_size=16, shuffle=True, seed=3)
    assert remote.dataset == "s3://bench/bench-ds"
    try:
        for epoch in (0, 1):
            before, logged = store.traffic(), len(store.served())
            theirs = epoch_batches(remote, epoch)
            served, requests = store.traffic() - before, store.served(since=logged)
            ours = epoch_batches(local, epoch)
            assert len(theirs) == len(ours) == 3
            for (xa, ya), (xb, yb) in zip(ours, theirs, strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
            if epoch == 0:  # epoch 1 may have been read ahead during epoch 0: its bytes counted there
                shard = lake / "bench-ds" / shard_relpath("train", 0, 1)
                assert (
                    served.gets >= 1
                    and served.requests == served.gets + served.heads + served.lists + served.other
                )
                assert served.body_bytes >= read_columns_bytes(shard, ["image", "label", "is_pad"])
                assert served.body_bytes <= 3 * shard.stat().st_size  # nothing read many times over
                assert served.bytes_sent > served.body_bytes  # headers too
                # The log names each file request and its range: ranged GETs of the shard.
                assert len(requests) == served.gets + served.heads
                assert any(
                    r.startswith("GET 206 ") and f"/{shard_relpath('train', 0, 1)}" in r and '"bytes=' in r
                    for r in requests
                )
                assert sum(int(r.split()[2]) for r in requests) == served.body_bytes
    finally:
        local.close()
        remote.close()
    assert store.traffic().connections >= 1


@pytest.mark.slow
def test_the_store_answers_what_s3fs_asks(store: RemoteStore, lake: Path):
    import boto3
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": store.endpoint, "region_name": "us-east-1"})
    info_path = lake / "bench-ds" / "dataset.json"
    info = fs.info("bench/bench-ds/dataset.json")
    assert info["size"] == info_path.stat().st_size and info["type"] == "file"
    assert info["ETag"] and info["LastModified"]
    assert fs.exists("bench/bench-ds/dataset.json")
    assert not fs.exists("bench/bench-ds/missing.json")  # HEAD 404, then a list that finds nothing
    assert fs.exists("bench/bench-ds/shards")  # a "folder": found by listing
    assert fs.isdir("bench/bench-ds/shards")
    with pytest.raises(FileNotFoundError):
        fs.cat("bench/bench-ds/missing.json")
    data = info_path.read_bytes()
    assert fs.cat_file("bench/bench-ds/dataset.json", start=5, end=25) == data[5:25]  # a ranged GET
    assert sorted(fs.ls("bench/bench-ds", detail=False)) == sorted(
        f"bench/bench-ds/{p.name}" for p in (lake / "bench-ds").iterdir()
    )

    # ListObjectsV2 pages: every key once, in order, across pages of two.
    client = boto3.client("s3", endpoint_url=store.endpoint, region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket="bench", Prefix="bench-ds/files/class1/", MaxKeys=2
    )
    keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    on_disk = sorted(
        f"bench-ds/files/class1/{p.name}" for p in (lake / "bench-ds" / "files" / "class1").iterdir()
    )
    assert keys == on_disk and len(keys) == 4
    assert store.traffic().lists >= 3  # two from exists/isdir, and the pages

    # ETags of an object uploaded in one PUT (no "-", which marks a multipart upload's): the
    # same in a listing, a HEAD and a GET, and a GET with If-Match of it is answered, another 412.
    listed = {
        obj["Key"]: obj["ETag"]
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket="bench", Prefix="bench-ds/files/class1/"
        )
        for obj in page["Contents"]
    }
    key = keys[0]
    head = client.head_object(Bucket="bench", Key=key)["ETag"]
    got = client.get_object(Bucket="bench", Key=key, IfMatch=head)
    assert got["Body"].read() == (lake / key).read_bytes()
    assert "-" not in head and head == listed[key] == got["ETag"]
    with pytest.raises(Exception, match=r"412|PreconditionFailed"):
        client.get_object(
            Bucket="bench", Key=key, IfMatch=head.replace(head[2], "f" if head[2] != "f" else "e")
        )

    # Read-only: a write is refused, not stored.
    with pytest.raises(Exception, match=r"405|Not Allowed|MethodNotAllowed"):
        client.put_object(Bucket="bench", Key="bench-ds/new.txt", Body=b"x")
    assert not (lake / "bench-ds" / "new.txt").exists()


def test_the_store_stops_every_process(nginx: str, lake: Path):
    with RemoteStore(lake, latency_ms=1) as store:
        pids = store.pids
        assert len(pids) == 2 and all(map(alive, pids))
    assert not any(map(alive, pids))
    store.stop()  # idempotent

    # Also when the body of the with block raises.
    with pytest.raises(RuntimeError, match="boom"), RemoteStore(lake) as store:
        pids = store.pids
        raise RuntimeError("boom")
    assert not any(map(alive, pids))


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_the_store_command_stopped_with_sigterm_leaves_no_nginx(nginx: str, lake: Path):
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/remote_store.py", str(lake), "--latency-ms", "1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("AWS_ENDPOINT_URL=")
        assert proc.stdout.readline().startswith("serving ")
        servers = _children(proc.pid)  # nginx's master and the shim, started by the command
        assert len(servers) == 2 and all(map(alive, servers))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert not any(map(alive, servers))  # stop() waits for both before the command exits


def test_a_store_runs_once_and_a_started_store_in_a_with_block_is_stopped(nginx: str, lake: Path):
    """A store started with start() and then used as a context manager runs one nginx and one
    shim, stopped at the end of the block (incremental_bench.py once started a second pair this
    way and left the first nginx running)."""
    store = RemoteStore(lake, latency_ms=1).start()
    first = store.pids
    with pytest.raises(RuntimeError, match="already running"):
        store.start()
    with store as same:
        assert same is store and store.pids == first
    assert not any(map(alive, first))


def test_the_store_checks_its_arguments(tmp_path: Path):
    with pytest.raises(ValueError, match=r"root must be an existing folder, got '.*nowhere'"):
        RemoteStore(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"bucket must be an S3 bucket name.*'B'"):
        RemoteStore(tmp_path, bucket="B")
    with pytest.raises(ValueError, match="latency_ms must be >= 0, got -1"):
        RemoteStore(tmp_path, latency_ms=-1)
    assert parse_rate("80MB") == 80_000_000
    assert parse_rate("25MiB") == 25 * 2**20
    assert parse_rate("500k") == 500_000
    assert parse_rate("1.5MB/s") == 1_500_000
    with pytest.raises(ValueError, match=r"bandwidth must be a positive size per second.*'fast'"):
        parse_rate("fast")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_remote_bench_measures_both_sources_and_the_traffic(nginx: str, tmp_path: Path):
    out = tmp_path / "remote.json"
    done = run(
        "benchmarks/remote_bench.py",
        "--images",
        "40",
        "--size",
        "32",
        "--repeats",
        "1",
        "--epochs",
        "2",
        "--latency-ms",
        "1",
        "--workdir",
        str(tmp_path),
        "--out",
        str(out),
        "--loader-option",
        "num_threads=1,prefetch=2",
    )
    assert done.returncode == 0, done.stderr
    assert "first batch: identical from local disk and from the store" in done.stderr
    result = json.loads(out.read_text())
    assert (
        result["images"] == 40 and result["latency_ms"] == 1 and result["bandwidth_bytes_per_s"] == 80_000_000
    )
    assert result["args"]["options"] == {"num_threads": 1, "prefetch": 2}
    for source in ("local", "remote"):
        (run_,) = result["runs"][source]
        assert all(run_[f"epoch{e}"] > 0 and run_[f"epoch{e}_first_batch_s"] > 0 for e in (1, 2))
        assert all(
            0 < run_[f"epoch{e}_gap_s"] < 40 / run_[f"epoch{e}"] for e in (1, 2)
        )  # less than the epoch
        assert run_["fresh_first_batch_s"] > 0
        assert 0 < run_["process_constructor_s"] < run_["process_first_batch_s"]
    epochs = result["summary"]["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert epochs[0]["traffic"]["gets"] >= 1 and epochs[0]["traffic"]["body_bytes"] > 0
    fresh = result["summary"]["fresh_first_batch_traffic"]
    # dataset.json, the shard's footer (one suffix-range GET: no HEAD), its row groups
    assert fresh["heads"] == 0 and fresh["gets"] >= 3 and fresh["connections"] >= 1
    process = result["summary"]["process_first_batch_traffic"]  # the new process read from the store too
    assert process["heads"] == 0 and process["gets"] >= 3 and process["connections"] >= 1
    assert result["store_total"]["body_bytes"] >= (
        sum(e["traffic"]["body_bytes"] for e in epochs) + fresh["body_bytes"] + process["body_bytes"]
    )
    assert not any(map(alive, result["store_pids"]))
    assert (
        "bound: MB/bw" in done.stdout
        and "gap local" in done.stdout
        and "fresh loader, first batch" in done.stdout
    )
    assert "new process, first batch" in done.stdout
    assert all(e["typical_gap_s"]["remote"] > 0 for e in epochs)
    # CPU seconds per epoch: the loader's (this process), nginx's (the store's server), the shim's.
    for e in epochs:
        assert e["cpu_s"]["local"]["loader"] > 0 and e["cpu_s"]["remote"]["loader"] > 0
        assert all(e["cpu_s"][s][k] >= 0 for s in ("local", "remote") for k in ("store_server", "shim"))
    assert "epoch 1 CPU s: loader local" in done.stdout and "store's server (nginx)" in done.stdout


#: A process (``parent``) that starts a child; each burns 0.4 s of CPU, then the parent says
#: ``burnt`` and both wait for their stdin to close (their CPU still theirs to read).
_BURN = r"""
import subprocess, sys, time
child = None
if sys.argv[1] == "parent":
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[2], "child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
end = time.process_time() + 0.4
while time.process_time() < end:
    pass
if child is not None:
    child.stdout.readline()  # the child has burnt its share too
print("burnt", flush=True)
sys.stdin.read()
"""


def test_procs_cpu_s_counts_a_process_and_its_descendants():
    """What remote_bench records for the store's server (nginx's master and its workers): the CPU
    of the processes named and of their children, read while they live."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _BURN, "parent", _BURN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "burnt"
        assert procs_cpu_s([proc.pid]) >= 0.8  # 0.4 s each, the child's included
        assert procs_cpu_s([]) == 0 and procs_cpu_s([2**22 + 1]) == 0  # none, and one not there
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


@pytest.mark.slow  # starts python and imports torch: ~5 s
def test_remote_bench_refuses_an_unknown_loader_option(tmp_path: Path):
    bad = run(
        "benchmarks/remote_bench.py", "--workdir", str(tmp_path), "--loader-option", "cache_dirr=/tmp/x"
    )
    assert bad.returncode == 2
    assert "'cache_dirr' in variant 'cache_dirr=/tmp/x' is not a ShardLoader option" in bad.stderr
    assert not list(tmp_path.iterdir())  # refused before building anything


def test_the_store_serves_many_keep_alive_connections_at_once(store: RemoteStore, lake: Path):
    """Eight clients at once, three ranged GETs each on one kept-alive connection: every
    client gets its own bytes, over its own connection."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    key = "bench-ds/" + shard_relpath("train", 0, 1)
    data = (lake / key).read_bytes()
    port = int(store.endpoint.rsplit(":", 1)[1])
    before = store.traffic()

    def client(i: int) -> list[bool]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        same = []
        for j in range(3):
            lo = (i * 3 + j) * 997 % (len(data) - 5000)
            conn.request("GET", f"/bench/{key}", headers={"Range": f"bytes={lo}-{lo + 4999}"})
            response = conn.getresponse()
            same.append(response.status == 206 and response.read() == data[lo : lo + 5000])
        conn.close()
        return same

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client, range(8)))
    assert results == [[True] * 3] * 8
    served = store.traffic() - before
    assert (served.connections, served.gets, served.body_bytes) == (8, 24, 24 * 5000)


def test_the_store_relays_each_kind_of_response_on_one_connection(store: RemoteStore, lake: Path):
    """The shim relays nginx's responses one by one (head, then ``Content-Length`` bytes of
    body): a HEAD (a length, no body), a 404 (a body of its own), a ranged GET of several relay
    chunks, a whole GET and a 412, in turn on one kept-alive connection, each intact. (nginx
    closes a connection after a 412, so that comes last.)"""
    import http.client

    key = "relay/blob.bin"
    data = np.random.default_rng(0).bytes(700_000)  # several of the shim's chunks
    (lake / "relay").mkdir(exist_ok=True)
    (lake / key).write_bytes(data)
    before = store.traffic()
    conn = http.client.HTTPConnection("127.0.0.1", int(store.endpoint.rsplit(":", 1)[1]), timeout=30)
    seen = []
    for method, path, headers in [
        ("HEAD", key, {}),
        ("GET", "relay/missing.bin", {}),
        ("HEAD", key, {}),
        ("GET", key, {"Range": "bytes=1000-600999"}),
        ("GET", key, {}),
        ("GET", key, {"If-Match": '"00000000000"'}),
    ]:
        conn.request(method, f"/bench/{path}", headers=headers)
        response = conn.getresponse()
        seen.append((method, response.status, response.getheader("Content-Length"), response.read()))
    conn.close()
    assert [(m, status) for m, status, _, _ in seen] == [
        ("HEAD", 200),
        ("GET", 404),
        ("HEAD", 200),
        ("GET", 206),
        ("GET", 200),
        ("GET", 412),
    ]
    assert seen[0][2:] == seen[2][2:] == (str(len(data)), b"")
    assert b"NoSuchKey" in seen[1][3] and seen[5][3]
    assert seen[3][3] == data[1000:601000] and seen[4][3] == data
    assert (store.traffic() - before).connections == 1


def test_no_response_arrives_before_its_latency_and_its_bytes_at_the_bandwidth(nginx: str, lake: Path):
    """The store is never faster than it claims: each response is complete no sooner than
    ``latency + bytes / bandwidth`` after its request (bodies of one byte to several relay
    chunks, on one connection and on a new one each)."""
    import http.client

    data = np.random.default_rng(1).bytes(1_500_000)
    (lake / "pace").mkdir(exist_ok=True)
    (lake / "pace" / "blob.bin").write_bytes(data)
    latency_s, rate = 0.03, 10_000_000
    with RemoteStore(lake, latency_ms=latency_s * 1000, bandwidth=rate) as running:
        port = int(running.endpoint.rsplit(":", 1)[1])
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        early = []
        for n in (1, 50_000, 300_000, 1_500_000):
            for conn in (kept, http.client.HTTPConnection("127.0.0.1", port, timeout=30)):
                start = time.monotonic()
                conn.request("GET", "/bench/pace/blob.bin", headers={"Range": f"bytes=0-{n - 1}"})
                body = conn.getresponse().read()
                took = time.monotonic() - start
                assert body == data[:n]
                if took < latency_s + n / rate:
                    early.append((n, round(took, 4), round(latency_s + n / rate, 4)))
            conn.close()
        kept.close()
    assert early == []


class _Chunked(BaseHTTPRequestHandler):
    """An HTTP/1.1 server's answer in chunks, the connection kept open after it (as Azurite
    answers a listing)."""

    protocol_version = "HTTP/1.1"
    BODY = (b"hello ", b"chunked ", b"world")

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in self.BODY:
            self.wfile.write(b"%x;piece\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\nX-Trailer: yes\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


def test_a_chunked_answer_ends_at_its_last_chunk_not_when_the_server_closes(tmp_path: Path):
    """In front of a server (``upstream=``), the shim relays a chunked body up to its last chunk,
    then reads the client's next request. Before, it waited for the server to close: each Azurite
    listing stalled for Node's 5 s keep-alive, and here (a server that keeps the connection) the
    second request never got its answer."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chunked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    body = b"".join(_Chunked.BODY)
    try:
        with RemoteStore(tmp_path, latency_ms=1, upstream=f"http://127.0.0.1:{server.server_port}") as store:
            conn = http.client.HTTPConnection("127.0.0.1", int(store.endpoint.rsplit(":", 1)[1]), timeout=60)
            for _ in range(2):  # on one connection
                conn.request("GET", "/bucket/key")
                answer = conn.getresponse()
                assert (answer.status, answer.read()) == (200, body)
            conn.close()
            assert store.traffic().body_bytes == 2 * len(body)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.azure
@pytest.mark.slow  # starts Azurite, python and torch: ~20 s
def test_remote_bench_runs_the_shim_in_front_of_azurite(tmp_path: Path):
    """``--store azure``: the same shim, passing Azurite's answers through, late and paced; the
    loader reads the same batches from it as from disk, and the shim counts what it relayed."""
    from tests.helpers.azurite import require_azurite

    require_azurite()
    out = tmp_path / "remote.json"
    done = run(
        "benchmarks/remote_bench.py",
        *("--store", "azure", "--images", "40", "--size", "32", "--repeats", "1", "--epochs", "2"),
        *("--latency-ms", "1", "--workdir", str(tmp_path), "--out", str(out)),
    )
    assert done.returncode == 0, done.stderr
    assert "first batch: identical from local disk and from the store" in done.stderr
    assert "remote (azure): 1 ms before each response" in done.stdout
    result = json.loads(out.read_text())
    epochs = result["summary"]["epochs"]
    assert epochs[0]["traffic"]["gets"] >= 1 and epochs[0]["traffic"]["body_bytes"] > 0
    fresh = result["summary"]["fresh_first_batch_traffic"]
    # dataset.json, the shard's footer (a HEAD for its size, then a GET: Azure has no suffix range), its row groups
    assert fresh["heads"] == 1 and fresh["gets"] >= 3 and fresh["connections"] >= 1
    assert result["store_total"]["body_bytes"] >= sum(e["traffic"]["body_bytes"] for e in epochs)
    assert not any(map(alive, result["store_pids"]))
    assert "store's server (Azurite)" in done.stdout and all(
        e["cpu_s"]["remote"]["loader"] > 0 for e in epochs
    )


@pytest.mark.slow
@pytest.mark.gcs
def test_remote_bench_puts_the_shim_in_front_of_the_gcs_emulator(tmp_path: Path):
    out = tmp_path / "remote.json"
    common = ["--images", "40", "--size", "32", "--repeats", "1", "--epochs", "2", "--latency-ms", "1"]
    done = run(
        "benchmarks/remote_bench.py", *common, "--store", "gcs", "--workdir", str(tmp_path), "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "first batch: identical from local disk and from the store" in done.stderr
    result = json.loads(out.read_text())
    assert result["args"]["store"] == "gcs" and "remote (gcs)" in done.stdout
    epochs = result["summary"]["epochs"]
    assert epochs[0]["traffic"]["gets"] >= 1 and epochs[0]["traffic"]["body_bytes"] > 0
    fresh = result["summary"]["fresh_first_batch_traffic"]  # dataset.json, the footer, row groups
    assert fresh["gets"] >= 3 and fresh["heads"] == 0
    assert all(run_["epoch2"] > 0 for run_ in (result["runs"]["local"][0], result["runs"]["remote"][0]))
    assert not any(map(alive, result["store_pids"]))
    assert "store's server (gcp-storage-emulator)" in done.stdout
    assert all(e["cpu_s"]["remote"]["store_server"] >= 0 for e in epochs)
