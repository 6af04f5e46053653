"""Every check before anything is measured: the options, the dataset and its channel, the
transform (imported and run once) and the model (built and run forward once). A bad one is a
:class:`~lakeshard.errors.PlatformError` naming it; nothing has been timed yet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lakeshard import format as contract
from lakeshard import storage
from lakeshard.errors import ConfigError
from lakeshard.format.label_columns import BOXES
from loaders.decode import BATCH_DECODERS
from loaders.doctor.config import DoctorConfig
from loaders.doctor.figures import Setup
from loaders.doctor.references import build_model, check_transform, load_reference
from loaders.options import LoaderOptions, default_threads, loader_values
from loaders.transforms import Transform, default_transform

__all__ = ["Plan", "prepare"]

#: The loader options that make the transform the stages measure (:func:`_transform`), not the
#: loader's.
_TRANSFORM = ("transform", "augment", "crop")


@dataclass(frozen=True, slots=True)
class Plan:
    """What the stages run with. ``options``: the loader options of the store and together
    stages (no decoder, no transform); ``input_shape``: ``(C, H, W)`` of the images the model
    takes; ``task``: the dataset's task kind (``None``: single-label)."""

    config: DoctorConfig
    setup: Setup
    num_classes: int
    options: dict[str, Any]
    transform: Transform | None
    input_shape: tuple[int, ...]
    model: nn.Module | None
    task: str | None = None


def _transform(config: DoctorConfig, image_size: int) -> tuple[Transform | None, str | None]:
    """The transform and how to name it: ``--transform``'s, or the loader's own for
    ``--augment``/``--crop``."""
    if config.transform is not None:
        fn = load_reference(
            config.transform, flag="--transform", expect="a callable fn(images, labels, generator)"
        )
        return fn, config.transform
    if config.crop is not None and config.crop > image_size:
        raise ConfigError(f"--crop {config.crop}: must be at most the image size {image_size} of the dataset")
    own = default_transform(augment=config.augment, crop=config.crop, normalize=None)
    return own, None if own is None else repr(own)


def prepare(config: DoctorConfig) -> Plan:
    """Check everything the stages need, in the order a user fixes it: the options, the dataset,
    the transform, the model."""
    threads = config.decode_threads
    options: dict[str, Any] = {
        **{k: v for k, v in loader_values(config).items() if k not in _TRANSFORM},
        "num_threads": threads,
        "shuffle": True,
        "seed": 0,
    }
    LoaderOptions.from_keywords(options)  # the loader's own checks of each option, before any read
    dataset = storage.normalize(config.dataset or "")
    info = contract.read_dataset_info(dataset)
    contract.channel_shards(dataset, info, config.channel)  # the channel is there
    size = info.image.size

    transform, name = _transform(config, size)
    input_shape: tuple[int, ...] = (3, size, size)
    if transform is not None:
        where = f"--transform {config.transform!r}" if config.transform else f"--augment/--crop ({name})"
        out = check_transform(where, transform, size=size, task=info.task, num_classes=info.num_classes)
        if out is None and config.model is not None:
            raise ConfigError(
                f"{where}: it does not return (images, labels) tensors, so the model step cannot take its batches"
            )
        input_shape = out or input_shape
    if config.model is not None and info.task == BOXES:
        raise ConfigError(
            f"--model {config.model!r}: {dataset} is a boxes dataset, and the model step is the trainer's, "
            "which trains classifiers: run the doctor without --model (your detection loop's model is yours "
            "to time)",
            option="model",
        )
    model = build_model(config.model, info.num_classes, input_shape) if config.model is not None else None
    setup = Setup(
        dataset=dataset,
        channel=config.channel,
        rank=config.rank,
        world_size=config.world_size,
        batch_size=config.batch_size,
        threads=threads,
        cores=default_threads(),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        image_size=size,
        input_size=input_shape[-1],
        remote=not storage.is_local(dataset),
        cache_dir=config.cache_dir,
        read_concurrency=config.read_concurrency,
        batch_decoder=bool(BATCH_DECODERS),
        transform=name,
        model=config.model,
    )
    return Plan(config, setup, info.num_classes, options, transform, input_shape, model, info.task)
