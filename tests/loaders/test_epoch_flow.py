"""Epochs as one stream: in a ``set_epoch(e); for batch in loader`` loop, once it has made a step
of one, epoch e + 1's first batches are read and decoded while epoch e's last ones are consumed
(the same pipeline stream runs on), with the batches of an epoch started afresh, within the
prefetch bound, and dropped when the loop goes elsewhere; a loader's first iteration (maybe its
only one) runs on into nothing (NOTE [ A loader's flow ] in loaders/_internal/run.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from loader_builders import ids_of, until, write_dataset

from loaders import ShardLoader

OPTIONS = {"batch_size": 4, "shuffle": True, "seed": 3, "shuffle_window": 12, "num_threads": 2, "prefetch": 2}


@pytest.fixture
def ds(tmp_path: Path) -> Path:
    write_dataset(
        tmp_path / "ds", rows={"train": 60, "validation": 4, "test": 4}, num_shards=2, row_group_rows=5
    )
    return tmp_path / "ds"


def afresh(ds: Path, epoch: int) -> list[list[int]]:
    """Epoch ``epoch`` of a new loader (nothing started early for it)."""
    with ShardLoader(str(ds), **OPTIONS) as loader:
        loader.set_epoch(epoch)
        return [ids_of(images) for images, _ in loader]


def test_the_next_epoch_s_first_batches_are_decoded_before_it_is_asked_for(ds: Path):
    """After epoch e (once the loop has made a step of one), epoch e + 1's first batches are
    decoded before the loop asks for them, the next iteration takes them from the same stream,
    and every epoch's batches are the ones an epoch started afresh yields."""
    with ShardLoader(str(ds), **OPTIONS) as loader:
        loader.set_epoch(0)
        assert [ids_of(images) for images, _ in loader] == afresh(ds, 0)
        first = loader.stats
        assert first.submitted == first.consumed == len(loader)  # a first iteration: maybe the only one
        for epoch in range(1, 4):
            loader.set_epoch(epoch)
            before = loader.stats
            got = [ids_of(images) for images, _ in loader]
            assert got == afresh(ds, epoch)
            if epoch > 1:
                assert loader.stats is before  # the stream that ran on into this epoch
            else:
                assert loader.stats is not first  # the first iteration's stream ended with it
            stats = loader.stats
            until(
                lambda s=stats: s.decoded >= s.consumed + 2, f"epoch {epoch + 1}'s first batches are decoded"
            )
            assert stats.consumed == len(loader) * (epoch if epoch > 1 else 1)


def test_a_jump_or_a_restored_state_closes_the_stream(ds: Path):
    """``set_epoch`` to another epoch than the next, or ``load_state_dict``, ends the stream that
    ran on (a new one starts) and yields the epoch asked for."""
    with ShardLoader(str(ds), **OPTIONS) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            list(loader)
        running = loader.stats
        loader.set_epoch(3)
        assert [ids_of(images) for images, _ in loader] == afresh(ds, 3)
        assert loader.stats is not running

        loader.set_epoch(4)
        batches = iter(loader)
        first = [ids_of(next(batches)[0]) for _ in range(3)]
        state = loader.state_dict()
        batches.close()
        running = loader.stats
        loader.load_state_dict(state)
        assert first + [ids_of(images) for images, _ in loader] == afresh(ds, 4)
        assert loader.stats is not running


def test_the_stream_holds_at_most_prefetch_plus_two_batches_outstanding(ds: Path):
    """With a slow training loop, the batches submitted and not yet consumed, whichever epoch
    they belong to, stay within the bound one epoch has."""
    bound = OPTIONS["prefetch"] + 2
    most = 0
    with ShardLoader(str(ds), **OPTIONS) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            for _ in loader:
                time.sleep(0.02)  # the pipeline runs ahead meanwhile
                most = max(most, loader.stats.submitted - loader.stats.consumed)
            if epoch:
                stats = loader.stats
                until(lambda s=stats: s.decoded > s.consumed, "the next epoch's first batch is decoded")
    assert 0 < most <= bound
