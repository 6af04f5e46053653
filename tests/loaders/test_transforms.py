"""User transforms (``ShardLoader(transform=fn)``) and the transforms of ``loaders.transforms``:
where they run, how they are seeded (resume included), how their errors surface, and what the
built-in options stand for."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from loader_builders import ids_of, write_dataset

from lakeshard.errors import ConfigError, LoaderError
from loaders import ShardLoader
from loaders.transforms import (
    CenterCrop,
    ColorJitter,
    Compose,
    Normalize,
    RandomFlipCrop,
    RandomResizedCrop,
    batch_generator,
)


def _noise_dataset(root: Path, *, train: int = 24, size: int = 12) -> str:
    write_dataset(
        root, rows={"train": train, "validation": 2, "test": 2}, num_shards=2, size=size, noise=True
    )
    return str(root)


class _Record:
    """A random transform that also records the thread it ran on and what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, type, torch.dtype, tuple[int, ...], torch.dtype]] = []

    def __call__(self, images, labels, generator):
        self.calls.append(
            (
                threading.current_thread().name,
                type(generator),
                images.dtype,
                tuple(images.shape),
                labels.dtype,
            )
        )
        noise = torch.randint(0, 50, images.shape, generator=generator, dtype=torch.int16)
        return {"images": images.to(torch.int16) + noise, "labels": labels, "ids": ids_of(images)}


def test_a_transform_runs_on_the_decode_threads_and_its_result_is_the_batch(dataset: Path):
    record = _Record()
    loader = ShardLoader(str(dataset), batch_size=8, num_threads=2, transform=record)
    batches = list(loader)
    assert len(batches) == 5 and all(isinstance(b, dict) for b in batches)
    assert [i for b in batches for i in b["ids"]] == list(range(40))
    assert all(re.fullmatch(r"lakeshard-r0-decode_\d+", c[0]) for c in record.calls), record.calls
    assert {c[1:] for c in record.calls} == {(torch.Generator, torch.uint8, (8, 3, 8, 8), torch.int64)}


def _noise(images, labels, generator):
    return torch.rand(images.shape[0], generator=generator)


def test_a_random_transform_is_reproducible_and_varies_by_batch_epoch_and_seed(dataset: Path):
    def run(seed: int, epoch: int, threads: int) -> torch.Tensor:
        loader = ShardLoader(str(dataset), batch_size=8, seed=seed, num_threads=threads, transform=_noise)
        loader.set_epoch(epoch)
        return torch.stack(list(loader))

    a = run(1, 0, 1)
    assert torch.equal(a, run(1, 0, 3))  # seeded per batch, not per thread
    assert len({tuple(row.tolist()) for row in a}) == 5  # each batch its own stream
    assert not torch.equal(a, run(1, 1, 1))  # each epoch
    assert not torch.equal(a, run(2, 0, 1))  # each seed


@pytest.mark.parametrize("stop", [1, 3, 5])
def test_resumed_loader_augments_like_an_uninterrupted_one(tmp_path: Path, stop: int):
    root = _noise_dataset(tmp_path)
    kwargs = dict(
        batch_size=4,
        shuffle=True,
        seed=3,
        shuffle_window=5,
        transform=Compose([RandomResizedCrop(8, scale=(0.3, 1.0)), ColorJitter(0.4, 0.4, 0.4)]),
    )
    reference = ShardLoader(root, **kwargs, num_threads=2)
    reference.set_epoch(2)
    expected = [(im.clone(), lab.clone()) for im, lab in reference]
    assert len(expected) == 6

    first = ShardLoader(root, **kwargs, num_threads=1)
    first.set_epoch(2)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = first.state_dict()
    first.close()

    resumed = ShardLoader(root, **kwargs, num_threads=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    rest = list(resumed)
    assert len(rest) == len(expected) - stop
    for (a, la), (b, lb) in zip(rest, expected[stop:], strict=True):
        assert a.shape == (4, 3, 8, 8)
        assert torch.equal(a, b) and torch.equal(la, lb)


def _fails_on_row_7(images, labels, generator):
    if 7 in ids_of(images):
        raise ValueError("cannot jitter sample 7")
    return images, labels


def test_a_failing_transform_reaches_the_training_loop_naming_the_shard_and_rows(dataset: Path):
    loader = ShardLoader(str(dataset), batch_size=4, num_threads=2, transform=_fails_on_row_7)
    seen = []
    with pytest.raises(LoaderError) as info:
        for images, _ in loader:
            seen += ids_of(images)
    message = str(info.value)
    assert seen in ([], [0, 1, 2, 3])  # the error may overtake the batch before it
    shard0 = re.escape(loader.shard_uris[0])
    assert re.search(
        rf"transform <function _fails_on_row_7 .*> failed on batch 1 \(rows 4, 5, 6, 7 of {shard0}\): "
        r"ValueError: cannot jitter sample 7",
        message,
    ), message
    assert isinstance(info.value.__cause__, ValueError)


def test_a_transform_returning_none_is_an_error(dataset: Path):
    with pytest.raises(
        LoaderError, match=r"returned None for batch 0 \(rows 0, 1, 2, 3, 4, 5, 6, 7, \.\.\. \(20 rows\) of "
    ):
        # one thread: batch 0 fails first (with two, batch 1's failure could come first)
        next(
            iter(
                ShardLoader(
                    str(dataset),
                    batch_size=20,
                    num_threads=1,
                    transform=lambda images, labels, generator: None,
                )
            )
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"transform": "flip"}, r"transform must be a callable or 'pkg.module:name', got 'flip'"),
        (
            {"transform": Normalize((0, 0, 0), (1, 1, 1)), "augment": True, "crop": 4},
            r"pass either transform= or the built-in augment, crop option\(s\), not both",
        ),
    ],
)
def test_bad_transform_options(dataset: Path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ShardLoader(str(dataset), **kwargs)


def test_the_builtin_options_are_the_default_transform(tmp_path: Path):
    root = _noise_dataset(tmp_path)
    norm = ((0.5, 0.25, 0.0), (0.5, 0.5, 1.0))
    pairs = [
        (dict(augment=True, crop=8, normalize=norm), Compose([RandomFlipCrop(8), Normalize(*norm)])),
        (dict(augment=True), RandomFlipCrop()),
        (dict(crop=6), CenterCrop(6)),
    ]
    for options, transform in pairs:
        builtin = [im for im, _ in ShardLoader(root, batch_size=5, seed=4, **options)]
        explicit = [im for im, _ in ShardLoader(root, batch_size=5, seed=4, transform=transform)]
        assert all(torch.equal(a, b) for a, b in zip(builtin, explicit, strict=True)), options


def _batch(n: int = 6, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, size, size, 3), generator=g, dtype=torch.uint8).permute(0, 3, 1, 2)
    return images, torch.arange(n)


@pytest.mark.parametrize(
    "transform, shape",
    [
        (RandomResizedCrop(8), (6, 3, 8, 8)),
        (RandomResizedCrop(20, scale=(0.5, 0.5), ratio=(2.0, 2.0)), (6, 3, 20, 20)),
        (ColorJitter(0.4, 0.4, 0.4), (6, 3, 16, 16)),
        (Compose([RandomResizedCrop(12), ColorJitter(0.2, 0.2, 0.2), RandomFlipCrop(10)]), (6, 3, 10, 10)),
    ],
)
def test_torch_op_transforms_shape_dtype_and_determinism(transform, shape):
    images, labels = _batch()
    out = [transform(images.clone(), labels, batch_generator(1, 0, 0, index)) for index in (0, 0, 1)]
    assert out[0][0].shape == shape and out[0][0].dtype == torch.uint8
    assert torch.equal(out[0][1], labels)
    assert torch.equal(out[0][0], out[1][0])  # same key, same images
    assert not torch.equal(out[0][0], out[2][0])  # another batch index, other draws


def test_random_resized_crop_of_the_whole_image_is_the_image():
    images, labels = _batch(size=8)
    out, _ = RandomResizedCrop(8, scale=(1.0, 1.0), ratio=(1.0, 1.0))(
        images, labels, batch_generator(0, 0, 0, 0)
    )
    assert torch.equal(out, images)


def test_color_jitter_keeps_a_grey_image_grey_and_zero_jitter_changes_nothing():
    images, labels = _batch()
    out, _ = ColorJitter()(images, labels, batch_generator(0, 0, 0, 0))
    assert torch.equal(out, images)
    grey = images[:, :1].expand(-1, 3, -1, -1).contiguous()
    out, _ = ColorJitter(0.0, 0.0, 0.9)(grey, labels, batch_generator(0, 0, 0, 0))
    assert torch.equal(out, grey)


def test_transform_arguments_are_checked():
    with pytest.raises(
        ConfigError, match=r"RandomResizedCrop scale must satisfy 0 < low <= high <= 1, got \(0.5, 2.0\)"
    ):
        RandomResizedCrop(8, scale=(0.5, 2.0))
    with pytest.raises(ConfigError, match=r"ColorJitter contrast must be in \[0, 1\], got 1.5"):
        ColorJitter(contrast=1.5)
    with pytest.raises(ConfigError, match="CenterCrop size must be a positive integer, got 0"):
        CenterCrop(0)
    with pytest.raises(ConfigError, match=r"Normalize mean must be 3 numbers \(one per RGB\D+, got 0.5$"):
        Normalize(0.5, 0.5)
    with pytest.raises(ConfigError, match=r"Normalize std must be positive \(images are divided by it\)"):
        Normalize([0, 0, 0], [1, 0, 1])
    with pytest.raises(ValueError, match=r"RandomFlipCrop: crop size 20 is larger than the images \(16x16\)"):
        RandomFlipCrop(20)(*_batch(), batch_generator(0, 0, 0, 0))
