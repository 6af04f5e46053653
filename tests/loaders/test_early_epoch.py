"""The next epoch started early: in a ``set_epoch(e); for batch in loader`` loop, once it has
made a step of one, epoch e + 1's first batches are decoded while epoch e's last ones are
consumed, with the batches of an epoch started afresh, within the prefetch bound, and dropped
when the loop goes elsewhere; a loader's first iteration (maybe its only one) starts nothing."""

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
    """After epoch e, epoch e + 1's first batches are decoded before the loop asks for them, the
    next iteration yields those very batches (its stats are the early epoch's), and every epoch's
    batches are the ones an epoch started afresh yields."""
    with ShardLoader(str(ds), **OPTIONS) as loader:
        loader.set_epoch(0)
        assert [ids_of(images) for images, _ in loader] == afresh(ds, 0)
        assert loader._started_early is None  # a first iteration: maybe the loader's only one
        for epoch in range(1, 4):
            loader.set_epoch(epoch)
            early = loader._started_early
            got = [ids_of(images) for images, _ in loader]
            assert got == afresh(ds, epoch)
            if epoch > 1:
                assert loader.stats is early.run.stats  # the epoch started early was used
            assert loader._started_early is not None and loader._started_early.epoch == epoch + 1
            until(
                lambda: loader._started_early.run.stats.decoded >= 2,
                f"epoch {epoch + 1}'s first batches are decoded",
            )
            assert loader._started_early.run.stats.consumed == 0


def test_a_jump_or_a_restored_state_drops_the_epoch_started_early(ds: Path):
    """``set_epoch`` to another epoch than the next, or ``load_state_dict``, stops the epoch
    started early (its threads' work ends) and yields the epoch asked for."""
    with ShardLoader(str(ds), **OPTIONS) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            list(loader)
        early = loader._started_early
        loader.set_epoch(3)
        assert [ids_of(images) for images, _ in loader] == afresh(ds, 3)
        assert early.run.stop.is_set() and loader.stats is not early.run.stats

        loader.set_epoch(4)
        batches = iter(loader)
        first = [ids_of(next(batches)[0]) for _ in range(3)]
        state = loader.state_dict()
        batches.close()
        early = loader._started_early
        loader.load_state_dict(state)
        assert early.run.stop.is_set()
        assert first + [ids_of(images) for images, _ in loader] == afresh(ds, 4)


def test_the_two_epochs_hold_at_most_prefetch_plus_two_batches_outstanding(ds: Path):
    """With a slow training loop, the batches submitted and not yet consumed, of the running
    epoch and the one started early together, stay within the bound one epoch has."""
    bound = OPTIONS["prefetch"] + 2
    most = 0
    with ShardLoader(str(ds), **OPTIONS) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            for _ in loader:
                time.sleep(0.02)  # the pipeline runs ahead meanwhile
                current, early = loader.stats, loader._started_early
                outstanding = current.submitted - current.consumed
                if early is not None:
                    outstanding += early.run.stats.submitted - early.run.stats.consumed
                most = max(most, outstanding)
            if epoch:
                until(
                    lambda: loader._started_early.run.stats.decoded >= 1,
                    "the next epoch's first batch is decoded",
                )
    assert 0 < most <= bound
