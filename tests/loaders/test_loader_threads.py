"""Errors reach the training loop promptly; a loader's threads live across epochs and stop on break, close, error and garbage collection."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
import torch
from loader_builders import ids_of, shard_path, write_dataset

from lakeshard.errors import ConfigError, LoaderError
from loaders import PAD_LABEL, ShardLoader, default_threads


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lakeshard")]


def test_threads_live_across_epochs_and_stop_on_break_and_close(dataset: Path):
    loader = ShardLoader(str(dataset), batch_size=2, num_threads=3, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 0:
            names = {t.name for t in loader_threads()}
            assert "lakeshard-r0-reader" in names
            assert any(n.startswith("lakeshard-r0-decode") for n in names)
        if i == 2:
            break
    assert loader_threads() == []
    assert loader.state_dict()["batches_consumed"] == 3
    assert len(list(loader)) == len(loader)
    threads = set(loader_threads())
    assert threads  # kept after an epoch that ran to its end
    for epoch in (1, 2):  # an epoch is a new order, not new threads
        loader.set_epoch(epoch)
        assert len(list(loader)) == len(loader)
    # The same threads live on (the decode pool may have made the rest of its 3 lazily, as a
    # ThreadPoolExecutor does when every thread is busy: the next epoch started early keeps
    # them busier).
    now = set(loader_threads())
    assert threads <= now and {t for t in now if t.name.endswith("-reader")} == {
        t for t in threads if t.name.endswith("-reader")
    }
    assert len([t for t in now if "-decode" in t.name]) <= 3
    loader.close()
    assert loader_threads() == []
    assert len(list(loader)) == len(loader)  # a closed loader starts new threads if iterated again
    loader.close()
    assert loader_threads() == []


def test_threads_stop_when_the_loader_is_garbage_collected(dataset: Path):
    loader = ShardLoader(str(dataset), batch_size=3, num_threads=4)
    it = iter(loader)
    next(it)
    assert loader_threads()
    del loader, it
    gc.collect()
    assert loader_threads() == []


def test_close_stops_a_held_iterator_and_a_new_epoch_replaces_the_old(dataset: Path):
    loader = ShardLoader(str(dataset), batch_size=2, num_threads=2, prefetch=1)
    it = iter(loader)
    next(it)
    assert loader_threads()
    second = iter(loader)
    next(second)  # starting another iteration closes the first one's threads
    with pytest.raises(LoaderError, match="was closed"):
        next(it)
    loader.close()
    assert loader_threads() == []
    with pytest.raises(LoaderError, match="was closed"):
        next(second)
    with ShardLoader(str(dataset), batch_size=2) as ctx:
        next(iter(ctx))
    assert loader_threads() == []


def test_a_loader_iterated_on_another_thread_meanwhile_refuses_that_thread(dataset: Path):
    """Two real threads, one loader: the thread that starts iterating while the other one's
    iteration runs gets a LoaderError naming that thread; the first thread's epoch goes on,
    every batch of it; once it is done, the other thread may iterate. Every wait is bounded."""
    loader = ShardLoader(str(dataset), batch_size=2, num_threads=2, prefetch=1)
    first_batch, second_done = threading.Event(), threading.Event()
    got: dict[str, object] = {}

    def first() -> None:
        ids: list[int] = []
        try:
            for images, _ in loader:
                ids += ids_of(images)
                if len(ids) == 2:
                    first_batch.set()
                    assert second_done.wait(timeout=30), "the second thread did not finish"
            got["first"] = ids
        except BaseException as exc:  # the test asserts on it
            got["first"] = exc
            first_batch.set()

    def second() -> None:
        assert first_batch.wait(timeout=30), "the first thread got no batch"
        try:
            got["second"] = [ids_of(images) for images, _ in loader]
        except BaseException as exc:  # the test asserts on it
            got["second"] = exc
        finally:
            second_done.set()

    threads = [threading.Thread(target=f, name=f"trainer-{f.__name__}", daemon=True) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [t.name for t in threads if t.is_alive()] == [], f"hung; so far {got}"
    assert isinstance(got["second"], LoaderError), got
    message = str(got["second"])
    assert "is being iterated by thread 'trainer-first'" in message
    assert "'trainer-second'" in message
    assert got["first"] == list(range(40))  # the first thread's epoch, every row of it
    # Once the first thread's loop is done, another thread may iterate (one at a time).
    again = threading.Thread(target=lambda: got.update(again=sum(len(lab) for _, lab in loader)), daemon=True)
    again.start()
    again.join(timeout=60)
    assert not again.is_alive() and got["again"] == 40
    loader.close()
    assert loader_threads() == []


def test_an_epoch_closed_under_a_waiting_consumer_raises_instead_of_hanging():
    """The consumer thread waits in ``next`` (its task is not read yet) when another thread stops
    the epoch (what ``load_state_dict`` or a new epoch does): it must get a LoaderError, not wait
    for a batch that no thread will ever queue."""
    from loaders._internal.pipeline import Pipeline

    release = threading.Event()

    def tasks():
        yield 0
        release.wait(timeout=60)  # the reader is slow to read the second task
        yield 1

    pipeline = Pipeline(num_threads=1, prefetch=1, name="lakeshard-test")
    epoch = pipeline.start(tasks(), lambda task, stop: task + 100)
    got: dict[str, object] = {}
    waiting = threading.Event()

    def consume() -> None:
        got["first"] = epoch.next()
        waiting.set()
        try:
            got["second"] = epoch.next()
        except BaseException as exc:  # the test asserts on it
            got["second"] = exc

    consumer = threading.Thread(target=consume, name="consumer", daemon=True)
    consumer.start()
    assert waiting.wait(timeout=30)
    stopper = threading.Thread(target=epoch.close, name="stopper", daemon=True)
    stopper.start()  # blocks until the reader leaves the epoch (after release)
    release.set()
    stopper.join(timeout=60)
    consumer.join(timeout=10)
    try:
        assert not consumer.is_alive(), "the consumer still waits on a closed epoch"
        assert got["first"] == 100
        assert isinstance(got["second"], LoaderError) and "closed" in str(got["second"]), got
    finally:
        pipeline.close()
    assert loader_threads() == []


@pytest.mark.parametrize("threads", [1, 4])
def test_decode_error_names_shard_and_row_before_its_batch_is_due(tmp_path: Path, threads: int):
    write_dataset(
        tmp_path, rows={"train": 60, "validation": 4, "test": 4}, num_shards=2, corrupt=[("train", 1, 17)]
    )
    loader = ShardLoader(str(tmp_path), batch_size=4, num_threads=threads, prefetch=2)
    yielded = 0
    with pytest.raises(LoaderError) as info:
        for _ in loader:
            yielded += 1
    message = str(info.value)
    assert message.startswith(
        f"cannot decode image at row 17 of file://{shard_path(tmp_path, 'train', 1, 2)}: "
    )
    assert "UnidentifiedImageError" in message  # Pillow's reason, after simplejpeg also refused
    assert info.value.__cause__ is not None  # the decode thread's own exception is chained
    assert yielded < 12  # row 17 of shard 1 is in batch (30 + 17) // 4 = 11: never yielded
    assert loader_threads() == []


def test_error_is_raised_while_the_consumer_waits_on_an_earlier_batch(tmp_path: Path, monkeypatch):
    """Batch 0 decodes slowly; batch 1 holds the bad row. The error must not wait for batch 0."""
    write_dataset(
        tmp_path, rows={"train": 8, "validation": 4, "test": 4}, num_shards=1, corrupt=[("train", 0, 5)]
    )
    from loaders import batch as batch_module

    release = threading.Event()
    real = batch_module.decode_batch

    stopped: list[bool] = []

    def slow_first(task, stop, spec):
        if task.index == 0 and spec.epoch == 0:  # not the next epoch's, started early
            stopped.append(stop.wait(timeout=60))  # True as soon as the pipeline stops
            release.set()
        return real(task, stop, spec)

    monkeypatch.setattr(batch_module, "decode_batch", slow_first)
    import loaders._internal.batch_decoding as sl

    monkeypatch.setattr(sl, "decode_batch", slow_first)
    loader = ShardLoader(str(tmp_path), batch_size=4, num_threads=2)
    with pytest.raises(LoaderError, match="row 5 of"):
        next(iter(loader))
    # Batch 0 could only finish once the pipeline stopped, which the error did: the error came
    # first, and the slow task was told to stop rather than running out its 60 s.
    assert release.wait(timeout=60)
    assert stopped == [True]
    assert loader_threads() == []


def test_skip_bad_rows_counts_and_reports(tmp_path: Path):
    write_dataset(
        tmp_path,
        rows={"train": 20, "validation": 4, "test": 4},
        num_shards=2,
        corrupt=[("train", 0, 3), ("train", 1, 8)],
    )
    loader = ShardLoader(str(tmp_path), batch_size=6, skip_bad_rows=True)
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    assert [len(lab) for _, lab in batches] == [6, 6, 6, 2]
    images = torch.cat([im for im, _ in batches])
    labels = torch.cat([lab for _, lab in batches])
    assert sorted((s.shard_uri.rsplit("/", 1)[-1], s.row) for s in loader.skipped_rows) == [
        ("part-00000-of-00002.parquet", 3),
        ("part-00001-of-00002.parquet", 8),
    ]
    assert all("cannot decode image" in s.reason for s in loader.skipped_rows)
    bad = [3, 10 + 8]
    assert labels[bad].tolist() == [PAD_LABEL, PAD_LABEL]
    assert images[bad].sum().item() == 0
    good = [i for i in range(20) if i not in bad]
    assert [ids_of(images)[i] for i in good] == good


def test_read_error_names_the_shard(tmp_path: Path):
    write_dataset(tmp_path, rows={"train": 40, "validation": 4, "test": 4}, num_shards=2)
    loader = ShardLoader(str(tmp_path), batch_size=4)
    shard = shard_path(tmp_path, "train", 1, 2)
    data = shard.read_bytes()
    shard.write_bytes(data[:4] + b"\0" * (len(data) - 4))  # same size, garbage row groups
    with pytest.raises(
        LoaderError,
        match=r"cannot read row group \d+ \(rows \d+-\d+\) of file://.*part-00001-of-00002.parquet",
    ):
        list(loader)
    assert loader_threads() == []


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 CPUs"
)
def test_default_threads_are_this_ranks_share_of_its_cpus(dataset: Path, monkeypatch):
    """One decode thread per CPU the process may run on, divided among torchrun's local ranks."""
    mine = os.sched_getaffinity(0)
    two = set(sorted(mine)[:2])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:
        os.sched_setaffinity(0, two)
        assert ShardLoader(str(dataset), batch_size=2).options.num_threads == 2
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert ShardLoader(str(dataset), batch_size=2).options.num_threads == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        os.sched_setaffinity(0, set(sorted(mine)[:1]))  # e.g. taskset -c 0, or a container's CPU set
        assert ShardLoader(str(dataset), batch_size=2).options.num_threads == 1
        assert ShardLoader(str(dataset), batch_size=2, num_threads=3).options.num_threads == 3  # given: kept
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
        with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE must be a positive integer, got 'two'"):
            ShardLoader(str(dataset), batch_size=2)
        # The trainer passes its local world size (and sets torch's threads to the same share).
        os.sched_setaffinity(0, two)
        assert (default_threads(1), default_threads(2), default_threads(3)) == (2, 1, 1)
    finally:
        os.sched_setaffinity(0, mine)
