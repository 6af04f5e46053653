"""Elastic resume through real :class:`ShardLoader` s: a state saved at one world size resumes at
another (local, S3 and GCS shards), every real sample of the interrupted epoch comes exactly once,
every new rank yields alike; bad resumes are refused with the sizes that would work."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_builders import ids_of, write_dataset
from test_remote_reads import upload

from lakeshard.errors import LoaderError
from loaders import PAD_LABEL, STATE_FORMAT, ShardLoader

HYPOTHESIS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    """2 shards of 23 rows (row groups of 5), 3 shards of 11 (row groups of 4)."""
    out = {}
    for name, n, rows, groups in [("2x23", 2, 46, 5), ("3x11", 3, 33, 4)]:
        root = tmp_path_factory.mktemp(name)
        write_dataset(
            root, rows={"train": rows, "validation": 3, "test": 3}, num_shards=n, row_group_rows=groups
        )
        out[name] = root
    return out


def _real(images: torch.Tensor, labels: torch.Tensor) -> list[int]:
    return [i for i, label in zip(ids_of(images), labels.tolist(), strict=True) if label != PAD_LABEL]


def _epoch(root: str, world: int, batch: int, **kw) -> Counter:
    """The real samples of an uninterrupted epoch on ``world`` ranks."""
    seen: Counter = Counter()
    for r in range(world):
        with ShardLoader(root, rank=r, world_size=world, batch_size=batch, **kw) as loader:
            for images, labels in loader:
                seen.update(_real(images, labels))
    return seen


def _consume(root: str, world: int, batch: int, k: int, state=None, **kw) -> tuple[Counter, dict]:
    """Every rank of ``world`` takes ``k`` batches (from ``state`` if given); returns their real
    samples and rank 0's state."""
    seen: Counter = Counter()
    saved = None
    for r in range(world):
        with ShardLoader(root, rank=r, world_size=world, batch_size=batch, **kw) as loader:
            if state is not None:
                loader.load_state_dict(state)
            it = iter(loader)
            for _ in range(k):
                seen.update(_real(*next(it)))
            if r == 0:
                saved = loader.state_dict()
    return seen, saved


def _finish(
    root: str, world: int, batch: int, state: dict, **kw
) -> tuple[Counter, list[list[int]], list[int]]:
    """Every rank of ``world`` resumes ``state`` and runs to the end of the epoch; returns the real
    samples, each rank's batch sizes and each rank's ``len(loader)``."""
    seen: Counter = Counter()
    sizes, lengths = [], []
    for r in range(world):
        with ShardLoader(root, rank=r, world_size=world, batch_size=batch, **kw) as loader:
            loader.load_state_dict(state)
            loader.set_epoch(state["epoch"])  # the saved epoch: keeps the position
            mine = []
            for images, labels in loader:
                mine.append(len(labels))
                seen.update(_real(images, labels))
            sizes.append(mine)
            lengths.append(len(loader))
            assert loader.state_dict()["batches_consumed"] == len(loader)
    return seen, sizes, lengths


@pytest.mark.slow
@HYPOTHESIS
@given(
    layout=st.sampled_from(["2x23", "3x11"]),
    worlds=st.sampled_from([(2, 1), (2, 3), (3, 2), (1, 4), (2, 6), (4, 3)]),
    per_global=st.sampled_from([1, 2]),
    k=st.integers(0, 6),
    drop_last=st.booleans(),
    remainder=st.sampled_from(["pad", "drop"]),
    shuffle=st.booleans(),
)
def test_the_rest_of_an_epoch_resumes_on_another_world_size_exactly_once(
    layouts, layout, worlds, per_global, k, drop_last, remainder, shuffle
):
    root = str(layouts[layout])
    w, w2 = worlds
    g = w * w2 * per_global  # a global batch both world sizes divide
    kw = dict(shuffle=shuffle, seed=4, shuffle_window=6, drop_last=drop_last, remainder=remainder)
    whole = _epoch(root, w, g // w, **kw)
    with ShardLoader(root, world_size=w, batch_size=g // w, **kw) as probe:
        k = min(k, len(probe))
    consumed, state = _consume(root, w, g // w, k, **kw)
    assert state["format"] == STATE_FORMAT and state["legs"] == [
        {"world_size": w, "batch_size": g // w, "batches": k}
    ]
    rest, sizes, lengths = _finish(root, w2, g // w2, state, **kw)
    assert consumed + rest == whole  # every real sample of the epoch exactly once
    steps = {len(s) for s in sizes}
    assert len(steps) == 1  # every new rank yields the same number of batches: DDP never waits
    assert set(lengths) == {k + steps.pop()}  # len(loader): the epoch's steps, before and after the resume
    for mine in sizes:  # whole per-rank batches of the new size, but the last
        assert all(n == g // w2 for n in mine[:-1]) and (not mine or 0 < mine[-1] <= g // w2)


def test_a_chained_resume_and_the_epochs_after_it(layouts):
    """2 ranks -> 3 -> 1 within one epoch: exactly once; the next epoch is a fresh 1-rank run."""
    root = str(layouts["2x23"])
    kw = dict(shuffle=True, seed=11, shuffle_window=7)
    whole = _epoch(root, 2, 3, **kw)
    first, state = _consume(root, 2, 3, 2, **kw)
    second, state = _consume(root, 3, 2, 3, state=state, **kw)
    assert state["legs"] == [
        {"world_size": 2, "batch_size": 3, "batches": 2},
        {"world_size": 3, "batch_size": 2, "batches": 3},
    ]
    assert state["batches_consumed"] == 5
    rest, sizes, lengths = _finish(root, 1, 6, state, **kw)
    assert first + second + rest == whole
    assert lengths == [5 + len(sizes[0])]
    with ShardLoader(root, batch_size=6, **kw) as loader:
        loader.load_state_dict(state)
        list(loader)
        loader.set_epoch(1)
        after = [(ids_of(i), lab.tolist()) for i, lab in loader]
        assert loader.state_dict()["legs"] == [{"world_size": 1, "batch_size": 6, "batches": len(after)}]
    with ShardLoader(root, batch_size=6, **kw) as fresh:
        fresh.set_epoch(1)
        assert after == [(ids_of(i), lab.tolist()) for i, lab in fresh]


def test_threads_and_prefetch_do_not_change_the_resumed_batches_nor_their_augmentation(layouts):
    root = str(layouts["3x11"])
    kw = dict(shuffle=True, seed=2, shuffle_window=5, augment=True, crop=6)
    _, state = _consume(root, 2, 4, 2, **kw)
    runs = []
    for threads, prefetch in ((1, 1), (3, 4)):
        with ShardLoader(
            root, rank=1, world_size=4, batch_size=2, num_threads=threads, prefetch=prefetch, **kw
        ) as loader:
            loader.load_state_dict(state)
            runs.append([(images.clone(), labels.clone()) for images, labels in loader])
    assert len(runs[0]) == len(runs[1]) > 0
    for (a, la), (b, lb) in zip(*runs, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_format_1_state_still_resumes(layouts):
    """A state the loader wrote before elastic resume (format 1) resumes as it always did, and at
    another world size too (without shuffle: that order is the same in both releases)."""
    root = str(layouts["2x23"])
    kw = dict(shuffle=False, seed=3, shuffle_window=6)
    with ShardLoader(root, rank=1, world_size=2, batch_size=3, **kw) as loader:
        version = loader.dataset_version
        full = [ids_of(images) for images, _ in loader]
    old = {
        "format": "lakeshard.ShardLoader/1",
        "dataset": root,
        "dataset_version": version,
        "channel": "train",
        "epoch": 0,
        "batches_consumed": 4,
        "order": {
            "world_size": 2,
            "batch_size": 3,
            "shuffle": False,
            "seed": 3,
            "drop_last": False,
            "remainder": "pad",
            "shuffle_window": 6,
            "rows_per_rank": 23,
        },
    }
    with ShardLoader(root, rank=1, world_size=2, batch_size=3, **kw) as loader:
        loader.load_state_dict(old)
        assert [ids_of(images) for images, _ in loader] == full[4:]
    consumed, _ = _consume(root, 2, 3, 4, **kw)
    rest, _, _ = _finish(root, 1, 6, old, **kw)
    assert consumed + rest == _epoch(root, 2, 3, **kw)
    with ShardLoader(root, rank=1, world_size=2, batch_size=3, **kw) as loader:
        with pytest.raises(LoaderError, match=r"rows_per_rank: saved 24, now 23"):
            loader.load_state_dict({**old, "order": {**old["order"], "rows_per_rank": 24}})


def test_a_format_1_state_saved_mid_epoch_with_shuffle_is_refused(layouts):
    """An earlier release shuffled an epoch's first windows otherwise (no ramp): the rest of an
    epoch it interrupted would be other rows. At an epoch boundary its state still resumes."""
    root = str(layouts["2x23"])
    kw = dict(shuffle=True, seed=3, shuffle_window=6)
    with ShardLoader(root, rank=1, world_size=2, batch_size=3, **kw) as loader:
        version = loader.dataset_version
        expected = [ids_of(images) for images, _ in (loader.set_epoch(1), loader)[1]]
    old = {
        "format": "lakeshard.ShardLoader/1",
        "dataset": root,
        "dataset_version": version,
        "channel": "train",
        "epoch": 0,
        "batches_consumed": 4,
        "order": {
            "world_size": 2,
            "batch_size": 3,
            "shuffle": True,
            "seed": 3,
            "drop_last": False,
            "remainder": "pad",
            "shuffle_window": 6,
            "rows_per_rank": 23,
        },
    }
    with ShardLoader(root, rank=1, world_size=2, batch_size=3, **kw) as loader:
        with pytest.raises(
            LoaderError, match=r"saved in the middle of epoch 0 \(after 4 batches\) by an earlier release"
        ):
            loader.load_state_dict(old)
        loader.load_state_dict({**old, "epoch": 1, "batches_consumed": 0})
        assert [ids_of(images) for images, _ in loader] == expected


def test_another_global_batch_is_refused_naming_the_sizes_that_work(layouts):
    root = str(layouts["2x23"])
    _, state = _consume(root, 2, 4, 1)  # global batch 8
    with ShardLoader(root, rank=0, world_size=4, batch_size=4) as loader:
        with pytest.raises(
            LoaderError,
            match=r"saved by 2 rank\(s\) x batch_size 4 = global batch 8, this loader has 4 "
            r"rank\(s\) x batch_size 4 = 16; pass batch_size=2 to continue the epoch",
        ):
            loader.load_state_dict(state)
    with ShardLoader(root, rank=0, world_size=3, batch_size=3) as loader:
        with pytest.raises(
            LoaderError,
            match=r"global batch of 8 cannot be split over 3 ranks: resume on a world size "
            r"that divides it \(1, 2, 4, 8\)",
        ):
            loader.load_state_dict(state)


def test_changed_order_settings_are_still_refused_at_another_world_size(layouts):
    root = str(layouts["2x23"])
    _, state = _consume(root, 2, 4, 1, shuffle=True, seed=1)
    for change, message in (
        ({"seed": 2}, "seed: saved 1, now 2"),
        ({"shuffle": False}, "shuffle: saved True, now False"),
        ({"drop_last": True}, "drop_last: saved False, now True"),
    ):
        with ShardLoader(
            root, world_size=1, batch_size=8, **{"shuffle": True, "seed": 1, **change}
        ) as loader:
            with pytest.raises(LoaderError, match=f"other settings \\({message}\\)"):
                loader.load_state_dict(state)
    bad_legs = {**state, "legs": [{"world_size": 2, "batch_size": 4}], "batches_consumed": 1}
    with ShardLoader(root, world_size=1, batch_size=8, shuffle=True, seed=1) as loader:
        with pytest.raises(LoaderError, match=r"leg 0 must be"):
            loader.load_state_dict(bad_legs)
        with pytest.raises(
            LoaderError, match=r"leg 0 \(2 ranks x 4 rows\) has 6 batches per rank, got 9 consumed"
        ):
            loader.load_state_dict(
                {**state, "legs": [{"world_size": 2, "batch_size": 4, "batches": 9}], "batches_consumed": 9}
            )


@pytest.mark.parametrize(
    "bucket",
    [
        pytest.param("s3_bucket", marks=pytest.mark.s3),
        pytest.param("gcs_bucket", marks=pytest.mark.gcs),
        pytest.param("az_container", marks=pytest.mark.azure),
    ],
)
def test_remote_shards_of_other_ranks_are_read_on_resume(
    layouts, bucket: str, request: pytest.FixtureRequest
):
    """On S3, GCS and Azure, a new rank reads rows that old ranks' shards hold: their footers are read
    at ``load_state_dict`` and their row groups fetched as ranged reads, as the loader's own."""
    local = layouts["3x11"]
    remote = upload(local, request.getfixturevalue(bucket))
    kw = dict(shuffle=True, seed=6, shuffle_window=5, read_concurrency=4)
    whole = _epoch(str(local), 2, 3, **kw)
    consumed, state = _consume(remote, 2, 3, 1, **kw)
    with ShardLoader(remote, rank=0, world_size=3, batch_size=2, **kw) as loader:
        assert loader.fetcher is not None and set(loader.source.remote) == {0}  # its own shard
        loader.load_state_dict(state)
        # old rank 0 read shard 1 too: its footer, read once, kept
        assert set(loader.source.remote) == {0, 1}
    rest, sizes, _ = _finish(remote, 3, 2, state, **kw)
    assert consumed + rest == whole
    assert len({len(s) for s in sizes}) == 1
    local_rest, _, _ = _finish(str(local), 3, 2, state, **kw)
    assert local_rest == rest
