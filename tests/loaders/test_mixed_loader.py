"""``MixedLoader``: several datasets, exact shares per epoch, equal batches on every rank,
every row of a source before any repeats, labels by name, and exact (elastic) resume.

The two datasets' sample ids are apart (A: 0.., B: 1000..), so the ids decoded from each batch
tell which source and which row every image came from, through the real read and decode path.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_builders import ids_of, write_dataset

from lakeshard.errors import ConfigError, DatasetError, LoaderError
from loaders import PAD_LABEL, MixedLoader

B_FIRST = 1000


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A: 40 train rows in 2 shards (row groups of 5); B: 10 rows in 2 shards."""
    root = tmp_path_factory.mktemp("mix")
    write_dataset(root / "a", rows={"train": 40, "validation": 6, "test": 6})
    write_dataset(
        root / "b", rows={"train": 10, "validation": 4, "test": 4}, first_id=B_FIRST, version="b0b0b0b0"
    )
    return str(root / "a"), str(root / "b")


def _mix(two: tuple[str, str], weights=(0.7, 0.3), **kw) -> MixedLoader:
    opts = dict(
        channel="train",
        batch_size=8,
        samples_per_epoch=80,
        seed=3,
        num_threads=2,
        shuffle_window=10,
        shuffle=True,
    )
    opts.update(kw)
    return MixedLoader(list(zip(two, weights, strict=True)), **opts)


def _epoch(loader: MixedLoader, epoch: int) -> list[list[int]]:
    loader.set_epoch(epoch)
    return [ids_of(images) for images, _ in loader]


def _all_ranks(two, world: int, epoch: int, **kw) -> list[list[list[int]]]:
    out = []
    for r in range(world):
        with _mix(two, rank=r, world_size=world, **kw) as ld:
            out.append(_epoch(ld, epoch))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_epoch_holds_the_exact_shares_and_every_rank_the_same_full_batches(two, world):
    batch = 16 // world
    for epoch in range(3):
        ranks = _all_ranks(two, world, epoch, batch_size=batch, samples_per_epoch=80)
        assert len({len(r) for r in ranks}) == 1
        assert all(len(b) == batch for r in ranks for b in r)
        flat = [i for r in ranks for b in r for i in b]
        from_b = [i for i in flat if i >= B_FIRST]
        assert (len(flat) - len(from_b), len(from_b)) == (56, 24)  # 0.7 and 0.3 of 80
        # A (40 rows) gives 56 a epoch: its stream runs on, epoch after epoch
        # B (10 rows) gives 24: each of its rows 2 or 3 times
        assert sorted(Counter(from_b).values()) == [2] * 6 + [3] * 4
        for r in ranks:  # each batch within one row of the weights
            for b in r:
                assert abs(sum(i >= B_FIRST for i in b) - 0.3 * batch) <= 1 + 1 / world


def test_a_source_is_read_whole_before_any_row_repeats(two):
    """Over epochs, source A's rows come as passes: each row once per pass, in passes of 40."""
    with _mix(two, weights=(0.5, 0.5), samples_per_epoch=48) as ld:  # A gives 24 an epoch
        stream = [i for e in range(5) for b in _epoch(ld, e) for i in b if i < B_FIRST]
    assert len(stream) == 120
    for p in range(3):
        assert sorted(stream[40 * p : 40 * (p + 1)]) == list(range(40))


def test_the_same_seed_and_epoch_give_the_same_batches_and_labels_follow_the_rows(two):
    with _mix(two) as a, _mix(two) as b:
        a.set_epoch(2)
        b.set_epoch(2)
        for (x, y), (u, v) in zip(a, b, strict=True):
            assert torch.equal(x, u) and torch.equal(y, v)
            assert y.tolist() == [i % 3 for i in ids_of(x)]
        assert a.source_rows == [56, 24]
    with _mix(two, seed=4) as c, _mix(two) as d:
        assert _epoch(c, 2) != _epoch(d, 2)


def test_a_source_smaller_than_a_batch_and_a_window_still_mixes(tmp_path, two):
    write_dataset(
        tmp_path / "tiny", rows={"train": 3, "validation": 0, "test": 0}, num_shards=1, first_id=5000
    )
    with MixedLoader(
        [(two[0], 0.5), (str(tmp_path / "tiny"), 0.5)], channel="train", batch_size=8, samples_per_epoch=32,
        shuffle_window=64, num_threads=1, seed=1,
    ) as ld:  # fmt: skip
        flat = [i for b in _epoch(ld, 0) for i in b]
    tiny = Counter(i for i in flat if i >= 5000)
    assert sum(tiny.values()) == 16 and sorted(tiny.values()) == [5, 5, 6]


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    old=st.sampled_from([1, 2, 4]),
    new=st.sampled_from([1, 2, 4]),
    stop=st.integers(0, 5),
    epoch=st.integers(0, 2),
)
def test_a_resumed_epoch_yields_exactly_the_rest_at_any_world_size(two, old, new, stop, epoch):
    """Run ``stop`` batches on ``old`` ranks, save rank 0's state, resume on ``new`` ranks: the
    consumed rows plus the resumed ranks' rows are the uninterrupted epoch's, each as often; at
    the same world size the resumed batches are the uninterrupted ones."""
    g = 16
    whole = Counter(i for r in _all_ranks(two, 1, epoch, batch_size=g) for b in r for i in b)
    seen: Counter = Counter()
    state = None
    for r in range(old):
        with _mix(two, rank=r, world_size=old, batch_size=g // old) as ld:
            ld.set_epoch(epoch)
            it = iter(ld)
            for _ in range(stop):
                seen.update(ids_of(next(it)[0]))
            if r == 0:
                state = ld.state_dict()
            rest = [ids_of(x) for x, _ in it]
        if old == new:
            with _mix(two, rank=r, world_size=new, batch_size=g // new) as ld:
                ld.load_state_dict(state)
                ld.set_epoch(epoch)
                assert [ids_of(x) for x, _ in ld] == rest
    lens = set()
    for r in range(new):
        with _mix(two, rank=r, world_size=new, batch_size=g // new) as ld:
            ld.load_state_dict(state)
            ld.set_epoch(epoch)
            got = [ids_of(x) for x, _ in ld]
            lens.add(len(got))
            assert len(ld) == stop + len(got)
            seen.update(i for b in got for i in b)
    assert len(lens) == 1
    assert seen == whole


def test_a_state_resumes_only_the_same_mixture(tmp_path, two):
    with _mix(two) as ld:
        ld.set_epoch(1)
        it = iter(ld)
        next(it)
        state = ld.state_dict()
        it.close()
    assert state["sources"][1] == {
        "dataset": f"file://{two[1]}",
        "dataset_version": "b0b0b0b0",
        "weight": 0.3,
    }
    with (
        _mix(two, weights=(0.6, 0.4)) as other,
        pytest.raises(LoaderError, match=r"a had weight 0\.7 .* now 0\.6"),
    ):
        other.load_state_dict(state)
    with _mix(two, samples_per_epoch=160) as other, pytest.raises(LoaderError, match="samples_per_epoch 80"):
        other.load_state_dict(state)
    with _mix(two, seed=9) as other, pytest.raises(LoaderError, match="seed: saved 3, now 9"):
        other.load_state_dict(state)
    with (
        _mix((two[1], two[0]), weights=(0.3, 0.7)) as other,
        pytest.raises(LoaderError, match=r"mixes file://.*/a, file://.*/b in that order .* another order"),
    ):  # F6: the same mixture in another order is named as such, not as rebuilt datasets
        other.load_state_dict(state)
    with _mix(two, batch_size=4) as other, pytest.raises(LoaderError, match="global batch 8"):
        other.load_state_dict(state)
    rebuilt = tmp_path / "b"
    write_dataset(
        rebuilt, rows={"train": 10, "validation": 4, "test": 4}, first_id=B_FIRST, version="b1b1b1b1"
    )
    moved = {
        **state,
        "sources": [state["sources"][0], {**state["sources"][1], "dataset": f"file://{rebuilt}"}],
    }
    with _mix((two[0], str(rebuilt))) as other, pytest.raises(DatasetError, match="was version 'b0b0b0b0'"):
        other.load_state_dict(moved)
    with _mix(two) as other, pytest.raises(LoaderError, match="not a MixedLoader state"):
        other.load_state_dict({"format": "lakeshard.ShardLoader/2"})


def test_labels_are_joined_by_name(tmp_path, two):
    write_dataset(
        tmp_path / "c", rows={"train": 12, "validation": 0, "test": 0}, num_shards=1, first_id=3000,
        label_names=["class2", "zebra", "class0"],
    )  # fmt: skip
    with MixedLoader(
        [two[0], str(tmp_path / "c")], channel="train", batch_size=4, num_threads=1
    ) as ld:  # no weights: each weighs its rows (40 and 12)
        assert ld.labels == {"class0": 0, "class1": 1, "class2": 2, "zebra": 3}
        assert ld.per_source == [40, 12]
        space = {0: "class2", 1: "zebra", 2: "class0"}  # dataset c's own label indices
        for images, labels in ld:
            for i, y in zip(ids_of(images), labels.tolist(), strict=True):
                want = ld.labels[space[i % 3]] if i >= 3000 else i % 3
                assert y == want
    with pytest.raises(DatasetError, match=r"only in .*/c: \['zebra'\]"):
        MixedLoader([two[0], str(tmp_path / "c")], channel="train", batch_size=4, labels="same")


def test_bad_mixtures_are_refused_before_any_read(tmp_path, two):
    a, b = two
    cases = [
        (
            dict(sources=[(a, 0.5), (b, -1)]),
            ConfigError,
            r"sources\[1\] .*weight must be a positive number, got -1",
        ),
        (dict(sources=[(a, 0.5), b]), ConfigError, "give every source a weight or none"),
        (dict(sources=a), ConfigError, "sources must be a non-empty list"),
        (
            dict(sources=[a, b], samples_per_epoch=7),
            ConfigError,
            "samples_per_epoch 7 is less than one global batch",
        ),
        (dict(sources=[a, b], drop_last=True), ConfigError, "drop_last does not apply to a mixture"),
        (dict(sources=[a, b], labels="any"), ConfigError, "labels must be one of"),
        (dict(sources=[a, b], decoder="none"), ConfigError, 'decoder="none" is not supported'),
        (dict(sources=[a, str(tmp_path / "nope")]), DatasetError, "nope"),
    ]
    for kw, error, message in cases:
        sources = kw.pop("sources")
        with pytest.raises(error, match=message):
            MixedLoader(sources, channel="train", batch_size=8, **kw)
    write_dataset(tmp_path / "big", rows={"train": 8, "validation": 0, "test": 0}, size=12, first_id=7000)
    with pytest.raises(DatasetError, match=r"images of different sizes .*pass crop=N"):
        MixedLoader([a, str(tmp_path / "big")], channel="train", batch_size=8)
    with MixedLoader([a, str(tmp_path / "big")], channel="train", batch_size=8, crop=8) as ld:
        assert next(iter(ld))[0].shape == (8, 3, 8, 8)


@pytest.mark.parametrize("spelling", ["{a}", "file://{a}", "{a}/"])
def test_the_same_dataset_twice_is_refused_naming_both_entries(two, spelling):
    a, b = two
    again = spelling.format(a=a)
    with pytest.raises(ConfigError) as info:
        MixedLoader([(a, 0.5), (b, 0.2), (again, 0.3)], channel="train", batch_size=8)
    message = str(info.value)
    assert f"sources[0] ({a}) and sources[2] ({again}) are the same dataset, file://{a}" in message
    assert "list each dataset once (sum its weights)" in message


def test_a_positive_weight_that_gets_no_row_is_refused_naming_the_least_that_does(two):
    a, b = two
    with pytest.raises(ConfigError) as info:
        MixedLoader([(a, 0.004), (b, 0.996)], channel="train", batch_size=6, samples_per_epoch=120)
    message = str(info.value)
    assert f"source {a} (weight 0.004, " in message and "gets 0 of the 120 samples of every epoch" in message
    least = float(message.split("a weight of at least ")[1].split(" ")[0])
    with MixedLoader([(a, least), (b, 0.996)], channel="train", batch_size=6, samples_per_epoch=120) as ld:
        assert ld.per_source[0] == 1
    # without weights each weighs its rows (40 and 10): 2 samples leave b none
    with pytest.raises(
        ConfigError, match=rf"source {b} \(weighed by its rows, 0.2 of the mixture\) gets 0 of the 2"
    ):
        MixedLoader([a, b], channel="train", batch_size=2, samples_per_epoch=2)


def test_numpy_weights_and_samples_per_epoch_are_numbers(two):
    a, b = two
    for weights in ((np.float32(0.7), np.float32(0.3)), (np.int64(7), np.int64(3))):
        with MixedLoader(
            list(zip(two, weights, strict=True)),
            channel="train",
            batch_size=8,
            samples_per_epoch=np.int64(80),
        ) as ld:
            assert (ld.per_source, ld.samples_per_epoch) == ([56, 24], 80)
    with pytest.raises(
        ConfigError, match=r"samples_per_epoch must be a positive integer, got np.float32\(80.0\)"
    ):
        MixedLoader([a, b], channel="train", batch_size=8, samples_per_epoch=np.float32(80))


def test_huge_weights_mix_by_their_ratio_and_an_absurd_ratio_is_refused(two):
    a, b = two
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning
        with MixedLoader([(a, 1e308), (b, 1e308)], channel="train", batch_size=5) as ld:
            assert ld.per_source == [25, 25]
        with pytest.raises(
            ConfigError, match=rf"source {b} \(weight 1e-300, 0 of the mixture\) gets 0 of the 50"
        ):
            MixedLoader([(a, 1e308), (b, 1e-300)], channel="train", batch_size=5)


def test_a_mixture_is_a_dataset_for_a_dataloader(two):
    with _mix(two) as ld:
        ds = ld.as_dataset()
        dl = torch.utils.data.DataLoader(ds, batch_size=None)
        ds.set_epoch(1)
        got = [ids_of(x) for x, _ in dl]
        assert len(got) == len(ds) == 10
        assert got == _epoch(ld, 1)


def test_skipped_rows_are_padding_in_a_mixture(tmp_path, two):
    write_dataset(
        tmp_path / "bad",
        rows={"train": 10, "validation": 0, "test": 0},
        first_id=8000,
        corrupt=[("train", 0, 1)],
    )
    with MixedLoader(
        [(two[0], 0.5), (str(tmp_path / "bad"), 0.5)], channel="train", batch_size=4, samples_per_epoch=20,
        skip_bad_rows=True, num_threads=1,
    ) as ld:  # fmt: skip
        labels = torch.cat([y for _, y in ld])
        assert int((labels == PAD_LABEL).sum()) == 1
        assert len(ld.skipped_rows) == 1


@pytest.mark.s3
@pytest.mark.slow
def test_a_mixture_of_remote_and_cached_sources_yields_the_local_batches(two, s3_bucket, tmp_path):
    """The same batches from S3 (ranged reads, and from the cache the first rank filled) as from
    disk, on each of two ranks over two epochs."""
    from tests.helpers.store import upload

    remote_a = upload(Path(two[0]), s3_bucket, "a")
    remote_b = upload(Path(two[1]), s3_bucket, "b")
    for rank in (0, 1):
        opts = dict(rank=rank, world_size=2, batch_size=4)
        with (
            _mix(two, **opts) as local,
            _mix((remote_a, remote_b), cache_dir=str(tmp_path / "c"), **opts) as far,
        ):
            for epoch in (0, 1):
                local.set_epoch(epoch)
                far.set_epoch(epoch)
                for (x, y), (u, v) in zip(local, far, strict=True):
                    assert torch.equal(x, u) and torch.equal(y, v)
            read = [src.fetcher.bytes_read for src in far.shard_sources]
            if rank == 0:  # its first epoch read the store and filled the cache
                assert all(n > 0 for n in read)
            else:  # a source's loader caches every shard of it: this node has them all now
                assert read == [0, 0]


def _two_views(images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator):
    """A batch and its mirror: twice the rows."""
    return torch.cat([images, images.flip(-1)]), torch.cat([labels, labels])


def _drop_pads(images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator):
    """The first row dropped: fewer rows."""
    return images[1:], labels[1:]


@pytest.mark.parametrize("transform", [_two_views, _drop_pads])
def test_a_transform_that_changes_a_batchs_rows_is_refused_not_skipped(two, transform):
    """A mixture takes each source's rows by position: a transform that makes more rows or fewer
    would skip or repeat rows silently, so its first batch is refused, naming the rule."""
    with _mix(two, transform=transform) as ld, pytest.raises(LoaderError, match="keeps each batch's rows"):
        for _ in ld:
            pass


def test_a_mixture_counts_its_totals_and_peak_bytes_as_one_loader(two):
    with _mix(two, rank=1, world_size=2, batch_size=4) as ld:
        before = ld.totals()
        assert (before.batches, before.rows_decoded) == (0, 0)
        batches = sum(1 for _ in ld)
        stats, after = ld.epoch_stats(), ld.totals()
        assert batches == len(ld) == stats.batches == after.batches == 10
        # every row of every source batch it decoded, at least the 40 it yielded
        assert stats.rows_decoded == after.rows_decoded >= 40
        assert ld.peak_bytes_held == 0 and stats.requests == 0  # local sources: no reads held, no GET


@pytest.mark.s3
def test_one_cost_budget_for_the_whole_mixture_names_its_rank(two, s3_bucket):
    """The budget is the mixture's, on this rank (not each source's at rank 0), and the message
    names the mixture and the rank."""
    from tests.helpers.store import upload

    remote = (upload(Path(two[0]), s3_bucket, "a"), upload(Path(two[1]), s3_bucket, "b"))
    with _mix(remote, rank=1, world_size=2, batch_size=4, cost_budget=1e-12, on_budget="stop") as ld:
        with pytest.raises(LoaderError, match=r"epoch 0 on rank 1 would cost \$[0-9.e-]+ in reads of mix\("):
            for _ in ld:
                pass
        assert ld.epoch_stats().requests > 0


def _mixture_costs(remote, epochs: int, **kw) -> list[float]:
    """Each epoch's cost of a mixture without a budget, once every read it made is in."""
    from tests.helpers.store import wait_reads_ended

    costs = []
    with _mix(remote, **kw) as ld:
        for epoch in range(epochs):
            ld.set_epoch(epoch)
            list(ld)
            for src in ld.shard_sources:
                wait_reads_ended(src)
            costs.append(ld.epoch_stats().cost_usd)
    return costs


@pytest.mark.s3
def test_a_mixture_budget_above_its_true_cost_never_stops_and_one_under_it_does(two, s3_bucket, caplog):
    """F7/F11: the mixture's one budget projects the bytes its source batches read, not the
    batches consumed: 2.5x each epoch's true cost runs every epoch to its end without a warning;
    a third of it stops, and so does an epoch of fewer than 8 batches. An epoch's cost counts the
    next epoch's first reads made by its end, as many as timing allows (under load, one run read
    ahead more than the run that measured the costs): at most one more epoch's reads here, where the
    shuffle window (40 rows) is the rank's whole epoch; hence 2.5x, not 1.2x."""
    from tests.helpers.store import upload

    remote = (upload(Path(two[0]), s3_bucket, "a"), upload(Path(two[1]), s3_bucket, "b"))
    opts = dict(rank=1, world_size=2, batch_size=2, read_concurrency=16, shuffle_window=40)
    costs = _mixture_costs(remote, 3, **opts)
    assert min(costs) > 0
    with _mix(remote, cost_budget=2.5 * max(costs), on_budget="stop", **opts) as ld:
        with caplog.at_level("WARNING", logger="loaders.stats"):
            for epoch in range(3):
                ld.set_epoch(epoch)
                assert sum(1 for _ in ld) == len(ld) == 20
    assert not [r for r in caplog.records if "cost_budget" in r.getMessage()]
    for kw in (opts, {**opts, "batch_size": 20}):  # 20 batches; 2 (under the 8 between checks)
        with _mix(remote, cost_budget=min(costs) / 3, on_budget="stop", **kw) as ld:
            with pytest.raises(LoaderError, match=r"epoch 0 on rank 1 would cost .*over cost_budget"):
                list(ld)


def _state_at(two, **kw) -> dict:
    with _mix(two, **kw) as ld:
        it = iter(ld)
        next(it)
        state = ld.state_dict()
        it.close()
    return state


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"batches_consumed": 99, "legs": [{"world_size": 2, "batch_size": 4, "batches": 99}]},
            "has 10 batches per rank, got 99",
        ),
        ({"legs": [{"world_size": 2, "batch_size": 4, "batches": 1, "x": 1}]}, "leg 0 must be"),
        (
            {"legs": [{"world_size": 0, "batch_size": 4, "batches": 0}], "batches_consumed": 0},
            "leg 0 must be",
        ),
        ({"legs": "many"}, "legs must be a non-empty list, got 'many'"),
        (
            {"batches_consumed": True, "legs": [{"world_size": 2, "batch_size": 4, "batches": 1}]},
            "do not add up",
        ),
    ],
)
def test_a_malformed_mixture_state_is_refused_naming_the_bad_field(two, change, message):
    """F18: a state past the epoch's end, an unknown key or a world size of 0 is a LoaderError
    that names it, before anything is changed."""
    state = _state_at(two, world_size=2, batch_size=4)
    with _mix(two, world_size=2, batch_size=4) as ld:
        with pytest.raises(LoaderError, match=message):
            ld.load_state_dict({**state, **change})
        assert ld.epoch == 0 and len(ld) == 10 and sum(1 for _ in ld) == 10


def test_a_mixture_state_at_another_global_batch_names_the_global_batch(two):
    """F19: 2 ranks x 8 (global 16), resumed at 3 ranks x 8: the global batch is what changed
    (samples_per_epoch, rounded to it, would change too), and the message says what works."""
    state = _state_at(two, world_size=2, batch_size=8)
    with _mix(two, world_size=3, batch_size=8) as ld:
        with pytest.raises(
            LoaderError, match=r"2 rank\(s\) x batch_size 8 = global batch 16, this loader has 3"
        ) as e:
            ld.load_state_dict(state)
        assert "samples_per_epoch" not in str(e.value) and "(1, 2, 4, 8, 16)" in str(e.value)


def test_a_mixture_runs_on_one_reader_thread_and_one_decode_pool(two):
    """Two sources, one pipeline: one reader thread and at most num_threads decode threads, as
    for one dataset (not a reader and a pool per source)."""
    import threading

    with _mix(two, num_threads=2) as ld:
        it = iter(ld)
        next(it)
        names = [t.name for t in threading.enumerate() if t.name.startswith("lakeshard")]
        it.close()
    assert sum(n.endswith("-reader") for n in names) == 1, names
    assert 1 <= sum("-decode" in n for n in names) <= 2, names


def test_a_second_iterating_thread_is_refused_naming_the_thread_that_iterates(two):
    """After an epoch on the main thread, one thread iterates and another tries to: the error
    names both of them (not the main thread, which iterates no more)."""
    import threading

    errors: list[str] = []
    with _mix(two) as ld:
        for _ in ld:
            pass
        started, release = threading.Event(), threading.Event()

        def first() -> None:
            it = iter(ld)
            next(it)
            started.set()
            release.wait(120)
            it.close()

        def second() -> None:
            try:
                next(iter(ld))
            except LoaderError as exc:
                errors.append(str(exc))

        holder = threading.Thread(target=first, name="first-iterator")
        holder.start()
        try:
            assert started.wait(120)
            other = threading.Thread(target=second, name="second-iterator")
            other.start()
            other.join(120)
        finally:
            release.set()
            holder.join(120)
    assert len(errors) == 1, errors
    assert "thread 'first-iterator'" in errors[0] and "thread 'second-iterator'" in errors[0], errors[0]


def test_an_iteration_begun_mid_epoch_starts_afresh_and_closes_the_older_one(two):
    """The flow into the next epoch is taken over only between epochs: a second iteration while
    one is under way gets the whole epoch, the first one's iterator is closed, and its end stops
    nothing of the second."""
    with _mix(two) as fresh:
        expected = _epoch(fresh, 2)
    with _mix(two) as ld:
        _epoch(ld, 0)
        _epoch(ld, 1)  # a step of one epoch: the flow runs on into epoch 2
        ld.set_epoch(2)
        older = iter(ld)
        next(older)
        assert [ids_of(images) for images, _ in ld] == expected
        with pytest.raises(LoaderError, match="closed"):
            next(older)
        older.close()
        assert len(_epoch(ld, 3)) == len(ld)  # the pipeline still runs
