"""The trainer's per-epoch loader figures: gathered from every rank into ``metrics.json`` and the
epoch's log line (requests, bytes, cost), the rank that held the others back named (a 2-rank
``torchrun`` whose rank 1 reaches the store over a slow link), and the same figures served as
Prometheus metrics while the run goes on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from loader_builders import write_dataset
from prometheus_client.parser import text_string_to_metric_families

from loaders.train.metrics import find_straggler
from tests.helpers.procs import listening_addresses
from tests.helpers.store import RemoteStore, require_nginx

REPO = Path(__file__).resolve().parents[3]

ARGS = ["--no-progress", "--no-augment", "--width", "4", "--num-threads", "1", "--shuffle-window", "8"]


def test_a_straggler_is_the_rank_that_waited_far_more_than_the_others():
    assert find_straggler([0.02, 0.31, 0.03, 0.02], [20.0, 180.0, 22.0, 19.0]) == (
        1,
        "rank 1 waited 31% for data, the others 2%-3%; its reads averaged 180 ms (the others 19-22 ms)",
    )
    assert find_straggler([0.40, 0.02], [0.0, 0.0]) == (0, "rank 0 waited 40% for data, the others 2%-2%")
    assert find_straggler([0.08, 0.01], [5.0, 5.0]) is None  # under 10%: nobody held anyone back
    assert find_straggler([0.30, 0.20], [5.0, 5.0]) is None  # all slow alike: the store, not a rank
    assert find_straggler([0.5], [5.0]) is None


@pytest.fixture()
def stores(tmp_path: Path) -> Iterator[tuple[RemoteStore, RemoteStore]]:
    """The same dataset ``ds`` (2 shards of 48 rows, row groups of 4) behind a fast link and a
    slow one (250 ms before each response)."""
    require_nginx()
    write_dataset(
        tmp_path / "lake" / "ds", rows={"train": 96, "validation": 8, "test": 8}, row_group_rows=4, noise=True
    )
    with (
        RemoteStore(tmp_path / "lake", latency_ms=0, bandwidth=500_000_000) as fast,
        RemoteStore(tmp_path / "lake", latency_ms=250, bandwidth=500_000_000) as slow,
    ):
        yield fast, slow


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_rank_behind_a_slow_link_is_named_with_its_read_time(stores, tmp_path: Path):
    fast, slow = stores
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "tests.hardening.endpoint_per_rank", "--dataset", fast.uri("ds"), "--output", str(out)]
    cmd += [*ARGS, "--batch-size", "8", "--epochs", "1", "--read-concurrency", "1", "--dist-timeout", "120"]
    env = {**os.environ, **fast.environ(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["LAKESHARD_TEST_ENDPOINT_1"] = slow.endpoint
    env.pop("AWS_ENDPOINT_URL_S3", None)
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    epoch = json.loads((out / "metrics.json").read_text())["epochs"][0]
    loader = epoch["loader"]
    assert loader["straggler"] == 1
    fast_ms, slow_ms = (r["read_ms_mean"] for r in loader["per_rank"])
    assert slow_ms >= 250 > fast_ms
    assert loader["straggler_line"].startswith(f"rank 1 waited {epoch['data_wait_share'][1]:.0%} for data")
    assert f"its reads averaged {slow_ms:.0f} ms" in loader["straggler_line"]
    assert f"epoch 0: straggler: {loader['straggler_line']}" in done.stderr
    # every rank read its shard's 12 row groups, one GET each (and may have read the next epoch's
    # first ones ahead before the figures were taken); the line says as much
    requests = [r["requests"] for r in loader["per_rank"]]
    assert all(12 <= n <= 14 for n in requests)
    assert loader["requests"] == sum(requests) and loader["bytes_read"] == sum(
        r["bytes_read"] for r in loader["per_rank"]
    )
    assert loader["cost_usd"] == pytest.approx(
        sum(requests) / 1000 * 0.0004 + loader["bytes_read"] / 2**30 * 0.02
    )
    assert (
        f"{sum(requests)} requests, {loader['bytes_read'] / 1e6:.1f} MB read, ${loader['cost_usd']:.3g}"
        in done.stderr
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("host", [None, "::1"], ids=["default: 127.0.0.1", "--metrics-host ::1"])
def test_the_figures_are_served_as_prometheus_metrics_while_the_run_goes_on(tmp_path: Path, host):
    data = tmp_path / "ds"
    write_dataset(data, rows={"train": 48, "validation": 8, "test": 8})
    port = _free_port()
    cmd = [sys.executable, "-m", "tests.hardening.recording_train", "--dataset", str(data)]
    cmd += ["--output", str(tmp_path / "run"), *ARGS, "--batch-size", "8", "--epochs", "2"]
    cmd += ["--metrics-port", str(port), *(["--metrics-host", host] if host else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO), "LAKESHARD_RECORD": str(tmp_path / "rec")}
    env["LAKESHARD_BATCH_SECONDS"] = "0.3"  # epoch 1 takes seconds: time to scrape epoch 0's figures
    with subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True) as proc:
        try:
            families = _scrape_epoch(f"[{host}]" if host else "127.0.0.1", port, proc, epoch=0)
            assert listening_addresses(port, proc.pid) == {
                host or "127.0.0.1"
            }  # the kernel's table, read while it serves
        finally:
            proc.kill()
    samples = {(s.name, s.labels.get("rank")): s.value for f in families for s in f.samples}
    assert samples[("lakeshard_epoch", None)] == 0
    assert samples[("lakeshard_images_per_s", None)] > 0
    assert 0 <= samples[("lakeshard_data_wait_share", "0")] <= 1
    assert samples[("lakeshard_epoch_requests", "0")] == 0  # a local dataset
    assert samples[("lakeshard_same_group_share", None)] > 0


def _scrape_epoch(host: str, port: int, proc: subprocess.Popen, *, epoch: int) -> list:
    """The metrics once ``lakeshard_epoch`` is ``epoch`` (polled while the run goes on)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first: {proc.stderr.read()[-3000:]}")
        try:
            text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
        except OSError:
            time.sleep(0.2)
            continue
        families = list(text_string_to_metric_families(text))
        if any(s.name == "lakeshard_epoch" and s.value == epoch for f in families for s in f.samples):
            return families
        time.sleep(0.2)
    raise AssertionError(f"no metrics of epoch {epoch} on port {port}")
