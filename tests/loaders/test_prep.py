"""``ShardLoader(prep="tcp://...")``: batches decoded and transformed on a dask.distributed
cluster are the batches the loader makes itself (pixels, augmentation draws, order, state); a
worker killed mid-epoch costs no batch; a cluster that goes away is an error naming it, or with
``prep_fallback`` the loader decodes on its own threads; a transform goes by reference."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from loader_builders import write_dataset

from lakeshard.errors import ConfigError, LoaderError
from loaders import ShardLoader
from loaders.options import LoaderOptions
from tests.helpers.dask_procs import DaskProcs, dask_procs, make_tls_files, warm
from tests.helpers.procs import refused_port, wait_for

pytestmark = pytest.mark.slow  # every test starts a Dask cluster of worker processes

OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 3, "shuffle_window": 16, "num_threads": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prep") / "ds"
    write_dataset(root, rows={"train": 96, "validation": 8, "test": 8}, size=16, fmt="jpeg", noise=True)
    return root


def _cluster(workers: int = 2):
    from distributed import LocalCluster

    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
    )
    warm(cluster.scheduler_address)  # a first batch is not timed against the workers' imports
    return cluster


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
        # Every batch on the cluster, and at most the read-ahead more: the loader's flow runs on
        # into epoch 2 as epoch 1 ends (docs/loader.md: up to prefetch + num_threads + 2 batches,
        # how many by timing; a CI run with two workers saw one).
        ahead = LoaderOptions().prefetch + OPTIONS["num_threads"] + 2
        assert len(expected) <= far.prep.batches <= len(expected) + ahead, far.prep.batches
        assert far.prep.local_batches == 0
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
                assert far.prep.local_batches > 0


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


# The tests below run the cluster as users do: ``dask scheduler`` and ``dask worker --no-nanny``
# processes (tests.helpers.dask_procs).

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskProcs]:
    with dask_procs(tmp_path_factory.mktemp("procs")) as running:
        yield running


def test_a_worker_running_other_code_is_refused_naming_both(data, tmp_path):
    """A worker whose PYTHONPATH holds a modified copy of ``loaders`` (another flip probability):
    the loader refuses its first batch, naming the worker and both code identities."""
    other = tmp_path / "othercode"
    shutil.copytree(REPO / "loaders", other / "loaders")
    transforms = other / "loaders" / "transforms.py"
    text = transforms.read_text()
    assert "< 0.5).numpy()" in text
    transforms.write_text(text.replace("< 0.5).numpy()", "< 0.25).numpy()"))
    with dask_procs(tmp_path / "c", worker_env={"PYTHONPATH": f"{other}{os.pathsep}{REPO}"}) as cluster:
        far = ShardLoader(str(data), prep=cluster.address, prep_fallback=True, augment=True, **OPTIONS)
        with far, pytest.raises(ConfigError) as info:
            next(iter(far))
    from loaders._internal.prep import code_identity

    message = str(info.value)
    assert message.startswith("prep worker tcp://127.0.0.1:") and "runs other code than the loader" in message
    mine = code_identity(None)
    assert f"the loader {mine}" in message
    theirs = message.split("the worker has ")[1].split(",")[0]
    assert theirs.startswith("lakeshard ") and theirs != mine


def test_a_transform_module_missing_on_the_workers_is_named(data, procs, tmp_path, monkeypatch):
    """Not 'the cluster stopped making batches', and no fallback: the module and the worker."""
    (tmp_path / "trainonly_parts.py").write_text(
        "def fn(images, labels, generator):\n    return images, labels\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # on this process's path only, not the workers'
    far = ShardLoader(
        str(data), prep=procs.address, prep_fallback=True, transform="trainonly_parts:fn", **OPTIONS
    )
    with far, pytest.raises(ConfigError) as info:
        next(iter(far))
    assert re.fullmatch(
        r"prep worker tcp://127\.0\.0\.1:\d+: transform 'trainonly_parts:fn': cannot import it: "
        r"ModuleNotFoundError: No module named 'trainonly_parts'; install it on the workers .*",
        str(info.value),
    )


def test_fallback_after_close_when_the_cluster_has_gone(data, tmp_path, caplog):
    """close() drops the client; the next epoch's reconnect fails: with prep_fallback, one WARNING
    and the epoch decoded here, the same batches."""
    with ShardLoader(str(data), **OPTIONS) as local:
        expected = _epochs(local, [1])
    with dask_procs(tmp_path / "c") as cluster:
        far = ShardLoader(str(data), prep=cluster.address, prep_timeout=15, prep_fallback=True, **OPTIONS)
        _epochs(far, [0])
        far.close()
        cluster.kill()
        port = int(cluster.address.rsplit(":", 1)[1])
        with refused_port(port), far, caplog.at_level(logging.WARNING, logger="loaders._internal.prep"):
            _same(_epochs(far, [1]), expected)
    warnings = [r.getMessage() for r in caplog.records if r.name == "loaders._internal.prep"]
    assert len(warnings) == 1 and "cannot reach the preparation cluster's scheduler" in warnings[0]
    assert warnings[0].endswith("decoding on this node from now on (prep_fallback=True)")


GONE_RUN = """
import os, signal, sys
from loaders import ShardLoader
data, address, *pids = sys.argv[1:]
with ShardLoader(data, batch_size=8, num_threads=2, prep=address, prep_fallback=True) as far:
    it = iter(far)
    next(it), next(it)
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    print("batches", 2 + sum(1 for _ in it))
"""


def test_a_cluster_gone_leaves_no_distributed_traceback_in_the_log(data, tmp_path):
    """A real run (its own process, distributed's logging as configured): the cluster killed
    mid-epoch, the epoch finishes here, and stderr holds the loader's one WARNING, nothing of
    distributed's (no ERROR, no traceback) when the loader closes its client."""
    with dask_procs(tmp_path / "c") as cluster:
        pids = [str(p.pid) for p in (cluster.scheduler, *cluster.workers)]
        run = subprocess.run(
            [sys.executable, "-c", GONE_RUN, str(data), cluster.address, *pids],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["batches", "12"]
    # (other lines may come: distributed's own notes on a busy machine, GC time, say)
    assert "Traceback" not in run.stderr and "- ERROR -" not in run.stderr, run.stderr[-3000:]
    assert "distributed.client" not in run.stderr, run.stderr[-3000:]
    warned = [line for line in run.stderr.splitlines() if "stopped making batches" in line]
    assert len(warned) == 1 and warned[0].endswith("decoding on this node from now on (prep_fallback=True)")


def test_tls_with_certificates_and_a_client_without_them_refused(data, tmp_path):
    """Scheduler and worker started with --tls-ca-file/--tls-cert/--tls-key: the loader given the
    client's files makes the loader's batches; without them, or with another CA's, it is refused."""
    tls, stranger = make_tls_files(tmp_path, "ca"), make_tls_files(tmp_path, "other-ca")
    with ShardLoader(str(data), **OPTIONS, augment=True) as local:
        expected = _epochs(local, [0])
    mine = {"ca_file": tls.ca_file, "cert": tls.cert, "key": tls.key}
    with dask_procs(tmp_path / "c", tls=tls) as cluster:
        assert cluster.address.startswith("tls://127.0.0.1:")
        with ShardLoader(str(data), prep=cluster.address, prep_security=mine, **OPTIONS, augment=True) as far:
            _same(_epochs(far, [0]), expected)
        with pytest.raises(ConfigError, match="is a TLS address and no certificates were given"):
            ShardLoader(str(data), prep=cluster.address, prep_timeout=10, **OPTIONS)
        theirs = {"ca_file": stranger.ca_file, "cert": stranger.cert, "key": stranger.key}
        with pytest.raises(
            ConfigError, match="the scheduler refused the connection: TLS certificate does not match"
        ):
            ShardLoader(str(data), prep=cluster.address, prep_security=theirs, prep_timeout=10, **OPTIONS)
        # trusting the cluster's CA but showing another CA's certificate: the scheduler refuses it
        forged = {"ca_file": tls.ca_file, "cert": stranger.cert, "key": stranger.key}
        with pytest.raises(ConfigError) as info:
            ShardLoader(str(data), prep=cluster.address, prep_security=forged, prep_timeout=10, **OPTIONS)
        assert str(info.value).startswith(f"prep={cluster.address!r}: the scheduler refused the connection")
        local = re.search(r"local=(tls://127\.0\.0\.1:\d+)", str(info.value)).group(1)
        refusal = f"TLS handshake failed with remote '{local}': [SSL: CERTIFICATE_VERIFY_FAILED]"
        # The scheduler's own log: it writes the line on its own loop, which a busy machine can run
        # after the client has already seen the refusal (CI once read the log too soon).
        wait_for(
            lambda: refusal in cluster.log_text(), f"{refusal!r} in the scheduler's log", 60, cluster.logs
        )


def test_prep_security_is_checked_before_connecting(data, tmp_path):
    files = make_tls_files(tmp_path)
    mine = {"ca_file": files.ca_file, "cert": files.cert, "key": files.key}
    with pytest.raises(
        ConfigError, match="prep_security is TLS to a preparation cluster: it needs prep='tls://"
    ):
        ShardLoader(str(data), prep="tcp://127.0.0.1:9", prep_security=mine, **OPTIONS)
    with pytest.raises(ConfigError, match=r"prep_security\['key'\]: no such file '/nowhere.pem'"):
        ShardLoader(
            str(data), prep="tls://127.0.0.1:9", prep_security={**mine, "key": "/nowhere.pem"}, **OPTIONS
        )
    with pytest.raises(
        ConfigError, match=r"prep_security must be a distributed\.security\.Security or a mapping"
    ):
        ShardLoader(str(data), prep="tls://127.0.0.1:9", prep_security=(files.ca_file,), **OPTIONS)


def test_the_trainer_trains_over_tls_with_its_flags(data, tmp_path):
    """`python -m loaders.train --prep tls://... --prep-tls-ca-file --prep-tls-cert --prep-tls-key`,
    as a command: an epoch trained on a TLS cluster; a flag without the others is one error line."""
    tls = make_tls_files(tmp_path)
    args = [
        sys.executable,
        "-m",
        "loaders.train",
        "--dataset",
        str(data),
        "--epochs",
        "1",
        "--batch-size",
        "8",
    ]
    args += ["--width", "4", "--no-progress", "--num-threads", "2", "--output", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with dask_procs(tmp_path / "c", tls=tls) as cluster:
        flags = ["--prep", cluster.address, "--prep-tls-ca-file", tls.ca_file, "--prep-tls-cert", tls.cert]
        run = subprocess.run(
            [*args, *flags, "--prep-tls-key", tls.key], capture_output=True, text=True, env=env
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert cluster.batches_made() >= 12  # an epoch of 96 rows in batches of 8, made there
    assert len(json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"]) == 1
    half = subprocess.run([*args, *flags], capture_output=True, text=True, env=env)
    assert half.returncode == 2
    assert half.stderr.strip().splitlines() == [
        "python -m loaders.train: error: prep_tls_ca_file, prep_tls_cert and prep_tls_key go together, with a "
        f"prep address tls://host:port; got prep={cluster.address!r}, prep_tls_ca_file={tls.ca_file!r}, "
        f"prep_tls_cert={tls.cert!r}, prep_tls_key=None"
    ]


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_distributeds_comm_closed_notice_is_dropped_only_for_the_loaders_own_client(tmp_path):
    """distributed logs "Batched Comm Closed" (INFO, with a traceback) when a cluster goes while a
    message is in flight: the loader's own client's connection is dropped (the loader says what
    happened), another connection's notice is kept."""
    from loaders._internal.prep import PrepCluster

    kept, logger = _Kept(), logging.getLogger("distributed.batched")
    logger.addHandler(kept)
    with dask_procs(tmp_path / "c") as cluster:
        prep = PrepCluster(cluster.address, timeout_s=15, fallback=True)
        try:
            ours, other = prep.client.scheduler_comm.comm, object()
            for comm in (ours, other):
                try:
                    raise ConnectionError("Stream is closed")
                except ConnectionError:
                    logger.info("Batched Comm Closed %r", comm, exc_info=True)
        finally:
            prep.close()
            logger.removeHandler(kept)
    assert [r.args for r in kept.records] == [(other,)]
