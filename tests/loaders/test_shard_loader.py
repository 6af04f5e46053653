"""ShardLoader behaviour through real Parquet files: coverage, determinism, resume, decoding."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_builders import CHANNEL_OFFSET, ids_of, shard_path, until, write_dataset

from lakeshard.errors import ConfigError, DatasetError, LoaderError
from loaders import PAD_LABEL, LoaderOptions, ShardLoader, decode

HYPOTHESIS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """Shard layouts: 2 shards of 21 rows, 3 shards of 13, 4 shards of 6 (row groups of 4)."""
    out = {}
    for name, n, rows in [("2x21", 2, 42), ("3x13", 3, 39), ("4x6", 4, 24)]:
        root = tmp_path_factory.mktemp(name)
        write_dataset(root, rows={"train": rows, "validation": 6, "test": 6}, num_shards=n, row_group_rows=4)
        out[name] = root
    return out


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def epoch_ids(loader: ShardLoader) -> list[list[int]]:
    return [ids_of(images) for images, _ in loader]


def assert_near_ids(images: torch.Tensor, expected) -> None:
    """JPEG is lossy: flat colours come back within a few levels."""
    red = images[:, 0].to(torch.int64).float().mean(dim=(1, 2))
    assert (red - torch.tensor(list(expected), dtype=torch.float32)).abs().max().item() <= 3


def test_batches_are_uint8_images_and_int64_labels(dataset: Path):
    loader = ShardLoader(str(dataset), batch_size=8, num_threads=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 5  # rank 0 of 1 reads both shards: 40 rows
    images, labels = batches[0]
    assert images.dtype == torch.uint8 and images.shape == (8, 3, 8, 8)
    assert images.is_contiguous(memory_format=torch.channels_last)  # zero-copy view of NHWC
    assert labels.dtype == torch.int64 and labels.shape == (8,)
    for images, labels in batches:
        assert [i % 3 for i in ids_of(images)] == labels.tolist()


@HYPOTHESIS
@given(
    layout=st.sampled_from(["2x21", "3x13", "4x6"]),
    world=st.integers(1, 5),
    batch=st.integers(1, 9),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    remainder=st.sampled_from(["pad", "drop"]),
)
def test_ranks_yield_equal_batches_and_cover_every_sample(
    datasets, layout, world, batch, drop_last, shuffle, remainder
):
    root = datasets[layout]
    total = {"2x21": 42, "3x13": 39, "4x6": 24}[layout]
    per_rank = total // world if remainder == "drop" else -(-total // world)
    options = dict(
        world_size=world,
        batch_size=batch,
        shuffle=shuffle,
        seed=3,
        drop_last=drop_last,
        remainder=remainder,
        num_threads=2,
        shuffle_window=5,
    )
    if drop_last and per_rank < batch:  # no whole batch on any rank: refused up front
        with pytest.raises(ConfigError, match="leaves no batch"):
            ShardLoader(str(root), rank=0, **options)
        return
    seen: Counter[int] = Counter()
    lengths, yielded, last_sizes = set(), set(), set()
    for rank in range(world):
        loader = ShardLoader(str(root), rank=rank, **options)
        lengths.add(len(loader))
        count = 0
        for images, labels in loader:
            count += 1
            last = len(labels)
            for sample, label in zip(ids_of(images), labels.tolist(), strict=True):
                if label != PAD_LABEL:
                    seen[sample] += 1
        yielded.add(count)
        last_sizes.add(last)
    assert len(lengths) == 1 and yielded == lengths  # same len on every rank, and exactly that many
    assert len(last_sizes) == 1  # the short last batch has the same size on every rank
    assert set(seen.values()) <= {1}  # never twice unpadded
    if not drop_last and remainder == "pad":
        assert sorted(seen) == list(range(total))  # every sample exactly once


def test_dataset_pad_rows_are_labelled_pad(tmp_path: Path):
    write_dataset(tmp_path, rows={"train": 20, "validation": 4, "test": 4}, num_shards=2, pad_rows=3)
    labels = torch.cat([lab for _, lab in ShardLoader(str(tmp_path), batch_size=4)])
    assert (labels == PAD_LABEL).sum().item() == 3
    assert labels[-3:].tolist() == [PAD_LABEL] * 3  # shard 1's last rows, unshuffled


def test_same_seed_same_batches_whatever_the_threads(datasets):
    root = str(datasets["3x13"])
    runs = [
        epoch_ids(
            ShardLoader(
                root, batch_size=5, shuffle=True, seed=11, num_threads=t, prefetch=p, shuffle_window=6
            )
        )
        for t, p in [(1, 1), (4, 2), (3, 8)]
    ]
    assert runs[0] == runs[1] == runs[2]
    assert sorted(flat(runs[0])) == list(range(39))
    other_seed = epoch_ids(ShardLoader(root, batch_size=5, shuffle=True, seed=12, shuffle_window=6))
    assert other_seed != runs[0]


def test_epochs_have_different_orders_and_are_reproducible(datasets):
    loader = ShardLoader(str(datasets["2x21"]), batch_size=6, shuffle=True, seed=5)
    orders = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        orders.append(epoch_ids(loader))
    assert orders[0] != orders[1]
    assert orders[0] == orders[2]


def test_an_epoch_starts_at_the_first_batch_not_at_iter(datasets):
    """``iter()`` then ``set_epoch()`` then ``next()`` (what PyTorch Lightning does on a resumed
    run) reads the epoch set last, also after a restored end-of-epoch state."""
    loader = ShardLoader(str(datasets["2x21"]), batch_size=6, shuffle=True, seed=5)
    loader.set_epoch(2)
    want = epoch_ids(loader)
    first = ShardLoader(str(datasets["2x21"]), batch_size=6, shuffle=True, seed=5)
    first.set_epoch(1)
    epoch_ids(first)
    resumed = ShardLoader(str(datasets["2x21"]), batch_size=6, shuffle=True, seed=5)
    resumed.load_state_dict(first.state_dict())  # epoch 1, every batch consumed
    batches = iter(resumed)
    resumed.set_epoch(2)
    assert [ids_of(images) for images, _ in batches] == want
    for each in (loader, first, resumed):
        each.close()


def test_no_shuffle_reads_shards_in_order(datasets):
    ids = flat(epoch_ids(ShardLoader(str(datasets["3x13"]), batch_size=7)))
    assert ids == list(range(39))


@pytest.mark.slow
@HYPOTHESIS
@given(stop=st.integers(0, 9), threads=st.sampled_from([1, 2, 5]), epoch=st.integers(0, 3))
def test_resume_mid_epoch_yields_the_remaining_batches(datasets, stop, threads, epoch):
    root = str(datasets["2x21"])
    kwargs = dict(batch_size=4, shuffle=True, seed=9, shuffle_window=7, augment=True)
    reference = ShardLoader(root, **kwargs, num_threads=2)
    reference.set_epoch(epoch)
    expected = [(images.clone(), labels.clone()) for images, labels in reference]
    assert len(expected) == 11

    first = ShardLoader(root, **kwargs, num_threads=3)
    first.set_epoch(epoch)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = first.state_dict()
    first.close()
    assert state["batches_consumed"] == stop and state["epoch"] == epoch

    resumed = ShardLoader(root, **kwargs, num_threads=threads)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # the saved epoch: keeps the position
    rest = list(resumed)
    assert len(rest) == len(expected) - stop
    for (a, la), (b, lb) in zip(rest, expected[stop:], strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert resumed.state_dict()["batches_consumed"] == len(expected)
    resumed.set_epoch(epoch + 1)  # another epoch starts from its beginning
    assert len(list(resumed)) == len(expected)


def test_rank0_state_resumes_another_rank(datasets):
    root = str(datasets["4x6"])
    r0 = ShardLoader(root, rank=0, world_size=2, batch_size=3, shuffle=True, seed=1)
    it = iter(r0)
    next(it)
    next(it)
    state = r0.state_dict()
    r0.close()
    r1 = ShardLoader(root, rank=1, world_size=2, batch_size=3, shuffle=True, seed=1)
    full = epoch_ids(r1)
    r1.load_state_dict(state)
    assert epoch_ids(r1) == full[2:]


def test_resume_refuses_a_changed_dataset(tmp_path: Path):
    root = tmp_path / "ds"
    write_dataset(root, version="aaaa1111")
    loader = ShardLoader(str(root), batch_size=4)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    write_dataset(root, version="bbbb2222", rows={"train": 44, "validation": 12, "test": 12})
    changed = ShardLoader(str(root), batch_size=4)
    with pytest.raises(DatasetError, match=r"refusing to resume.*'aaaa1111'.*'bbbb2222'"):
        changed.load_state_dict(state)


def test_resume_refuses_other_order_settings(dataset: Path):
    state = ShardLoader(str(dataset), batch_size=4, seed=1).state_dict()
    with pytest.raises(LoaderError, match="seed: saved 1, now 2"):
        ShardLoader(str(dataset), batch_size=4, seed=2).load_state_dict(state)
    with pytest.raises(LoaderError, match="not a ShardLoader state"):
        ShardLoader(str(dataset), batch_size=4).load_state_dict({"epoch": 1})


def test_first_batch_before_the_shard_is_read_and_prefetch_is_bounded(tmp_path: Path):
    write_dataset(tmp_path, rows={"train": 400, "validation": 4, "test": 4}, num_shards=1, row_group_rows=5)
    loader = ShardLoader(
        str(tmp_path), batch_size=4, shuffle=True, shuffle_window=10, num_threads=2, prefetch=2
    )
    it = iter(loader)
    next(it)
    assert loader.row_groups_read < 80 // 2  # far from the 80 row groups of the shard
    # A consumer that stops: the pipeline runs ahead as far as it may (the queue's 2 futures and
    # the one the reader holds, all decoded), and never further.
    stats = loader.stats
    until(
        lambda: stats.submitted - stats.consumed >= 2 + 1 and stats.decoded == stats.submitted,
        "the pipeline runs ahead of a stopped consumer",
    )
    assert stats.submitted - stats.consumed <= 2 + 2 and stats.max_in_flight <= 2 + 2
    for _ in it:
        pass
    assert loader.stats.max_in_flight <= 2 + 2
    assert loader.stats.consumed == loader.stats.decoded == len(loader) == 100


def test_jpeg_decoders_agree_and_auto_prefers_the_batch_decoder_then_simplejpeg(tmp_path: Path, monkeypatch):
    """``auto`` decodes each batch with ``loaders._jpeg`` (no per-image call) to simplejpeg's
    very pixels; without it, image by image with simplejpeg; Pillow's differ by rounding only."""
    write_dataset(tmp_path, rows={"train": 12, "validation": 2, "test": 2}, num_shards=1, fmt="jpeg", size=16)
    pil = torch.cat([im for im, _ in ShardLoader(str(tmp_path), batch_size=5, decoder="pillow")])
    sj = torch.cat([im for im, _ in ShardLoader(str(tmp_path), batch_size=5, decoder="simplejpeg")])
    calls = Counter()
    real_sj, real_pil = decode.decode_simplejpeg, decode.decode_pillow
    monkeypatch.setattr(decode, "decode_simplejpeg", lambda d, o=None: calls.update(["sj"]) or real_sj(d, o))
    monkeypatch.setattr(decode, "decode_pillow", lambda d, o=None: calls.update(["pil"]) or real_pil(d, o))
    assert set(decode.BATCH_DECODERS) == {"auto"}  # the extension is built here (test_decode.py)
    auto = torch.cat([im for im, _ in ShardLoader(str(tmp_path), batch_size=5, decoder="auto")])
    assert calls == {}
    assert torch.equal(auto, sj)
    monkeypatch.setattr(decode, "BATCH_DECODERS", {})
    one_by_one = torch.cat([im for im, _ in ShardLoader(str(tmp_path), batch_size=5, decoder="auto")])
    assert calls == {"sj": 12}
    assert torch.equal(one_by_one, sj)
    assert (pil.int() - auto.int()).abs().max().item() <= 2
    assert_near_ids(auto, range(12))


def test_pillow_fallback_without_simplejpeg(dataset: Path, tmp_path: Path, monkeypatch):
    write_dataset(tmp_path / "j", rows={"train": 6, "validation": 2, "test": 2}, num_shards=1, fmt="jpeg")
    monkeypatch.setattr(decode, "_simplejpeg", None)
    assert_near_ids(torch.cat([im for im, _ in ShardLoader(str(tmp_path / "j"), batch_size=4)]), range(6))
    png = flat(epoch_ids(ShardLoader(str(dataset), batch_size=4)))  # PNG always goes to Pillow
    assert png == list(range(40))


def test_normalize_crop_and_flip(tmp_path: Path):
    write_dataset(tmp_path, rows={"train": 16, "validation": 2, "test": 2}, num_shards=1, size=12, noise=True)
    plain = torch.cat([im for im, _ in ShardLoader(str(tmp_path), batch_size=4)])
    norm = torch.cat(
        [
            im
            for im, _ in ShardLoader(
                str(tmp_path), batch_size=4, normalize=((0.5, 0.25, 0.0), (0.5, 0.5, 1.0))
            )
        ]
    )
    assert norm.dtype == torch.float32
    mean = torch.tensor([0.5, 0.25, 0.0]).view(1, 3, 1, 1)
    std = torch.tensor([0.5, 0.5, 1.0]).view(1, 3, 1, 1)
    torch.testing.assert_close(norm, (plain.float() / 255 - mean) / std)

    center = torch.cat([im for im, _ in ShardLoader(str(tmp_path), batch_size=4, crop=8)])
    assert center.shape == (16, 3, 8, 8)
    assert torch.equal(center, plain[:, :, 2:10, 2:10])

    aug = [
        torch.cat(
            [im for im, _ in ShardLoader(str(tmp_path), batch_size=4, crop=8, augment=True, num_threads=t)]
        )
        for t in (1, 3)
    ]
    assert torch.equal(aug[0], aug[1])  # seeded per batch, not per thread
    # each augmented image is a (possibly flipped) 8x8 window of the original
    flips = 0
    for a, p in zip(aug[0], plain, strict=True):
        windows = [p[:, y : y + 8, x : x + 8] for y in range(5) for x in range(5)]
        if any(torch.equal(a, w) for w in windows):
            continue
        assert any(torch.equal(a.flip(-1), w) for w in windows)
        flips += 1
    assert 0 < flips < 16


def test_a_pathlib_path_is_a_dataset_like_its_string(dataset: Path):
    by_path, by_str = (
        ShardLoader(root, batch_size=7, shuffle=True, seed=2) for root in (dataset, str(dataset))
    )
    assert by_path.dataset == by_str.dataset
    assert epoch_ids(by_path) == epoch_ids(by_str)


def test_options_given_at_once_are_the_keywords(dataset: Path):
    options = LoaderOptions(batch_size=6, shuffle=True, seed=4, num_threads=2)
    by_options = ShardLoader(dataset, options=options)
    assert by_options.options is options
    assert epoch_ids(by_options) == epoch_ids(
        ShardLoader(dataset, batch_size=6, shuffle=True, seed=4, num_threads=2)
    )
    with pytest.raises(ConfigError, match=r"either as options= or as keywords, not both \(got \['seed'\]\)"):
        ShardLoader(dataset, options=options, seed=5)


def test_a_dataset_rebuilt_mid_epoch_is_refused_not_mixed(tmp_path: Path):
    """A shard the loader opens during an epoch (not only at construction) must be the build it
    started with: ``jobs.shard --overwrite`` replacing the files mid-epoch is a DatasetError
    naming the shard and both versions, not batches of two versions."""
    root, other = tmp_path / "ds", tmp_path / "other"
    for where, version in ((root, "aaaa1111"), (other, "bbbb2222")):
        write_dataset(where, rows={"train": 200, "validation": 4, "test": 4}, num_shards=2, version=version)
    loader = ShardLoader(root, batch_size=4, shuffle_window=5, num_threads=1, prefetch=1)
    batches = iter(loader)
    first = ids_of(next(batches)[0])
    assert first == [0, 1, 2, 3]
    for i in range(2):  # the rebuild: both shards replaced (shard 1 is not open yet)
        target = shard_path(root, "train", i, 2)
        tmp = target.with_suffix(".new")
        tmp.write_bytes(shard_path(other, "train", i, 2).read_bytes())
        tmp.replace(target)
    with pytest.raises(DatasetError) as err:
        for _ in batches:
            pass
    message = str(err.value)
    assert (
        "part-00001-of-00002.parquet footer says lakeshard.dataset_version='bbbb2222', expected 'aaaa1111'"
        in message
    )
    loader.close()


def test_file_uri_and_pin_memory_without_cuda(dataset: Path):
    loader = ShardLoader(dataset.as_uri(), batch_size=10, pin_memory=True)
    images, _ = next(iter(loader))
    loader.close()
    assert images.shape[0] == 10
    assert images.is_pinned() == torch.cuda.is_available()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"rank": 2, "world_size": 2}, r"rank must be an integer in \[0, world_size=2\), got 2"),
        ({"channel": "dev"}, "channel must be one of .* got 'dev'"),
        ({"decoder": "cv2"}, "decoder must be one of .* got 'cv2'"),
        ({"crop": 99}, "crop must be at most the image size 8, got 99"),
        ({"batch_size": 50, "drop_last": True}, "batch_size 50 with drop_last=True leaves no batch"),
    ],
)
def test_bad_options_are_named(dataset: Path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ShardLoader(str(dataset), **kwargs)


def test_an_unknown_keyword_is_refused_by_the_signature_and_by_from_keywords(dataset: Path):
    """Every option is a parameter of its own (what a type checker and an IDE see): a misspelt
    one is Python's TypeError; options read from a mapping get a ConfigError naming it."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'batch_sise'"):
        ShardLoader(str(dataset), batch_sise=4)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"unknown loader option\(s\) \['batch_sise'\]"):
        LoaderOptions.from_keywords({"batch_sise": 4})


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "name, value, message",
    [
        # normalize: (mean, std), 3 numbers each (the images are RGB), every std positive.
        (
            "normalize",
            (0.5, 0.5),
            r"normalize mean must be 3 numbers \(one per RGB channel\), got 0\.5 "
            r"\(normalize=\(0\.5, 0\.5\)\)",
        ),
        ("normalize", 0.5, r"normalize must be \(mean, std\), 3 numbers each .*, got 0\.5$"),
        ("normalize", "imagenet", r"normalize must be \(mean, std\), 3 numbers each .*, got 'imagenet'$"),
        ("normalize", ((0.5,) * 3,) * 3, r"normalize must be \(mean, std\), .*got \(\(0\.5"),
        ("normalize", ((0.5,), (0.5,)), r"normalize mean must be 3 numbers .*, got \(0\.5,\) "),
        ("normalize", ((0.5,) * 3, (0.5, 0.5)), r"normalize std must be 3 numbers .*, got \(0\.5, 0\.5\) "),
        ("normalize", ((0.5, 0.5, "a"), (1,) * 3), r"mean must be 3 numbers .*, got \(0\.5, 0\.5, 'a'\) "),
        ("normalize", ((True, 0, 0), (1, 1, 1)), r"normalize mean must be 3 numbers .*, got \(True, 0, 0\) "),
        ("normalize", ((0.5, 0.5, _NAN), (1,) * 3), r"mean must be finite, got \(0\.5, 0\.5, nan\) "),
        ("normalize", ((0.5,) * 3, (1, _INF, 1)), r"normalize std must be finite, got \(1, inf, 1\) "),
        ("normalize", ((0.5,) * 3, (1, 1, _NAN)), r"normalize std must be finite, got \(1, 1, nan\) "),
        ("normalize", ((0.5,) * 3, (0.2, 0.0, 0.2)), r"std must be positive .*, got \(0\.2, 0\.0, 0\.2\) "),
        ("normalize", ((0.5,) * 3, (0.2, 0.2, -1.0)), r"std must be positive .*, got \(0\.2, 0\.2, -1\.0\) "),
        # Other options of the wrong type: a ConfigError naming the option and the value.
        ("batch_size", "64", r"batch_size must be a positive integer, got '64'$"),
        ("num_threads", 0.5, r"num_threads must be a positive integer, got 0\.5$"),
        ("prefetch", None, r"prefetch must be a positive integer, got None$"),
        ("rank", True, r"rank must be an integer in \[0, world_size=1\), got True$"),
        ("seed", True, r"seed must be a non-negative integer, got True$"),
        ("shuffle", "no", r"shuffle must be True or False, got 'no'$"),
        ("drop_last", 1, r"drop_last must be True or False, got 1$"),
        ("augment", None, r"augment must be True or False, got None$"),
        ("pin_memory", "yes", r"pin_memory must be True or False, got 'yes'$"),
        ("skip_bad_rows", "no", r"skip_bad_rows must be True or False, got 'no'$"),
        (
            "decoder",
            ["auto"],
            r"decoder must be one of \['auto', 'pillow', 'simplejpeg'\], got \['auto'\] \(or 'none': the encoded bytes\)$",
        ),
        ("remainder", ["pad"], r"remainder must be one of \('pad', 'drop'\), got \['pad'\]$"),
        ("channel", ["train"], r"channel must be one of .*, got \['train'\]$"),
        ("crop", "8", r"crop must be a positive integer, got '8'$"),
        ("cache_limit", None, r"cache_limit: a size must look like .*, got None$"),
        ("memory_budget", [1], r"memory_budget: a size must look like .*, got \[1\]$"),
        ("cache_dir", 5, r"cache_dir must be a local folder, got 5$"),
    ],
)
def test_options_of_the_wrong_shape_or_type_are_named(dataset: Path, name, value, message):
    """A ConfigError naming the option and the bad value, from the constructor, before any
    thread starts: never a TypeError from deep inside, nor a value silently taken for another."""
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match=message):
        ShardLoader(str(dataset), **{name: value})
    with pytest.raises(ConfigError, match=message) as refused:
        LoaderOptions.from_keywords({name: value})
    assert refused.value.option == name  # the subject as data, for a command line to name its flag
    assert set(threading.enumerate()) == before


def test_normalize_lists_are_taken_as_tuples_of_floats():
    options = LoaderOptions.from_keywords(
        {"normalize": [[0, 0.5, 1], [1, 2, 0.25]]}
    )  # as a YAML file gives them
    assert options.normalize == ((0.0, 0.5, 1.0), (1.0, 2.0, 0.25))
    assert all(type(v) is float for part in options.normalize for v in part)


def test_incomplete_dataset_and_foreign_shards_are_refused(tmp_path: Path):
    root = tmp_path / "ds"
    write_dataset(root)
    (root / "dataset.json").unlink()
    with pytest.raises(DatasetError, match=r"dataset\.json does not exist"):
        ShardLoader(str(root))
    other = tmp_path / "other"
    write_dataset(root, version="v1")
    write_dataset(other, version="v2")
    shard_path(root, "train", 1, 2).write_bytes(shard_path(other, "train", 1, 2).read_bytes())
    with pytest.raises(
        DatasetError, match=r"part-00001-of-00002.parquet footer says lakeshard.dataset_version='v2'"
    ):
        ShardLoader(str(root))


def test_validation_channel_counts_offsets(dataset: Path):
    ids = flat(epoch_ids(ShardLoader(str(dataset), channel="validation", batch_size=5)))
    assert ids == [CHANNEL_OFFSET["validation"] + i for i in range(12)]
