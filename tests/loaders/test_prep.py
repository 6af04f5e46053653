"""``ShardLoader(prep="tcp://...")``: batches decoded and transformed on a dask.distributed
cluster are the batches the loader makes itself (pixels, augmentation draws, order, state); a
worker killed mid-epoch costs no batch; a cluster that goes away is an error naming it, or with
``prep_fallback`` the loader decodes on its own threads; a transform goes by reference."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from loader_builders import write_dataset

from lakeshard.errors import ConfigError, LoaderError
from loaders import ShardLoader

pytestmark = pytest.mark.slow  # every test starts a Dask cluster of worker processes

OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 3, "shuffle_window": 16, "num_threads": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prep") / "ds"
    write_dataset(root, rows={"train": 96, "validation": 8, "test": 8}, size=16, fmt="jpeg", noise=True)
    return root


def _cluster(workers: int = 2):
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    with _cluster() as running:
        yield running


def _epochs(loader: ShardLoader, epochs: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [(x.clone(), y.clone()) for x, y in loader]
    return out


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (x, y), (u, v) in zip(a, b, strict=True):
        assert torch.equal(x, u) and torch.equal(y, v)
        assert x.stride() == u.stride()  # channels_last kept: a model computes the same floats


@pytest.mark.parametrize(
    "transform",
    [dict(augment=True, crop=12), dict(transform="tests.helpers.prep_parts:jitter")],
    ids=["built-in augment", "transform by reference"],
)
def test_the_cluster_makes_the_batches_the_loader_makes(data, cluster, transform):
    with ShardLoader(str(data), **OPTIONS, **transform) as local:
        expected = _epochs(local, [0, 1])
    with ShardLoader(str(data), prep=cluster.scheduler_address, **OPTIONS, **transform) as far:
        _same(_epochs(far, [0, 1]), expected)
        assert far._prep.batches == len(expected) and far._prep.local_batches == 0
        # a state saved mid-epoch resumes with the same batches, cluster or not
        far.set_epoch(1)
        it = iter(far)
        for _ in range(3):
            next(it)
        state = far.state_dict()
        it.close()
    with ShardLoader(str(data), prep=cluster.scheduler_address, **OPTIONS, **transform) as again:
        again.load_state_dict(state)
        again.set_epoch(1)
        _same([(x.clone(), y.clone()) for x, y in again], expected[len(expected) // 2 + 3 :])


def test_a_worker_killed_mid_epoch_costs_no_batch(data, cluster):
    from distributed import Client

    with ShardLoader(str(data), **OPTIONS, augment=True) as local:
        expected = _epochs(local, [0])
    with (
        Client(cluster.scheduler_address) as client,
        ShardLoader(str(data), prep=cluster.scheduler_address, **OPTIONS, augment=True) as far,
    ):
        got, killed = [], None
        for i, (x, y) in enumerate(far):
            got.append((x.clone(), y.clone()))
            if i == 2:  # tasks are in flight on both workers: kill one of them
                pids = client.run(os.getpid)
                killed = sorted(pids.values())[0]
                os.kill(killed, signal.SIGKILL)
        _same(got, expected)
        assert killed is not None and killed not in client.run(os.getpid).values()


def test_a_cluster_that_goes_away_is_an_error_or_a_local_fallback(data):
    with ShardLoader(str(data), **OPTIONS) as local:
        expected = _epochs(local, [0])
    for fallback in (False, True):
        cluster = _cluster(workers=1)
        address = cluster.scheduler_address
        with ShardLoader(str(data), prep=address, prep_timeout=3, prep_fallback=fallback, **OPTIONS) as far:
            it = iter(far)
            got = [next(it) for _ in range(2)]
            cluster.close()
            began = time.monotonic()
            if not fallback:
                with pytest.raises(
                    LoaderError, match=f"the preparation cluster at {address} stopped making batches"
                ):
                    got += list(it)
                assert time.monotonic() - began < 30
            else:
                got += list(it)
                _same([(x.clone(), y.clone()) for x, y in got], expected)
                assert far._prep.local_batches > 0


def test_what_cannot_go_to_a_cluster_is_refused_before_any_work(data, cluster):
    with pytest.raises(ConfigError, match="cannot be found by reference; to run on a preparation cluster"):
        ShardLoader(str(data), prep=cluster.scheduler_address, transform=lambda x, y, g: (x, y), **OPTIONS)
    with pytest.raises(ConfigError, match="prep must be a dask scheduler address"):
        ShardLoader(str(data), prep="localhost", **OPTIONS)
    with pytest.raises(ConfigError, match=r"transform 'tests.helpers.prep_parts:nothing': cannot import it"):
        ShardLoader(str(data), transform="tests.helpers.prep_parts:nothing", **OPTIONS)
    began = time.monotonic()
    with pytest.raises(ConfigError, match="cannot reach the preparation cluster's scheduler within 2 s"):
        ShardLoader(str(data), prep="tcp://127.0.0.1:9", prep_timeout=2, **OPTIONS)
    assert time.monotonic() - began < 20


def test_the_trainer_with_prep_trains_as_without(data, cluster, tmp_path):
    """`python -m loaders.train --prep`: the same batches, so the same losses, epoch by epoch."""
    from loaders.train.loop import main

    args = ["--dataset", str(data), "--epochs", "2", "--batch-size", "8", "--width", "4", "--no-progress"]
    args += ["--num-threads", "2", "--shuffle-window", "16"]
    assert main([*args, "--output", str(tmp_path / "here")]) == 0
    assert main([*args, "--output", str(tmp_path / "there"), "--prep", cluster.scheduler_address]) == 0
    here, there = ((tmp_path / d / "metrics.json").read_text() for d in ("here", "there"))
    import json

    losses = [[e["loss"] for e in json.loads(m)["epochs"]] for m in (here, there)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
