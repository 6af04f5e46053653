"""The doctor's options: a frozen dataclass whose fields are the command line
(:func:`lakeshard.settings.add_arguments`), as the trainer's ``TrainConfig`` is."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from lakeshard.errors import ConfigError
from lakeshard.format import CHANNELS
from lakeshard.settings import add_arguments, check_positive, opt, resolve
from loaders.options import default_threads, option_default

__all__ = ["PROG", "DoctorConfig", "build_parser", "parse_args"]

PROG = "python -m loaders.doctor"


@dataclass(frozen=True, slots=True)
class DoctorConfig:
    dataset: str | None = opt(
        None, help="dataset root (local path, file:// or s3://): the folder holding dataset.json (required)"
    )
    channel: str = opt("train", help=f"the channel to read: {', '.join(CHANNELS)}")
    model: str | None = opt(
        None,
        help="your model: package.module:factory, a callable (num_classes, image_size) -> torch.nn.Module "
        "returning [batch, num_classes] logits (default: the model is not measured)",
    )
    batch_size: int = opt(64, help="rows per batch on this rank")
    transform: str | None = opt(
        None,
        help="a transform: package.module:name, a callable fn(images, labels, generator) run on each "
        "decoded batch (instead of --augment/--crop)",
    )
    augment: bool = opt(False, help="the loader's random flips (and random crops with --crop)")
    crop: int | None = opt(None, help="the loader's crop to N x N pixels (random with --augment)")
    threads: int | None = opt(
        None, help="decode threads, the cores decoding may use (default: the cores this process may use)"
    )
    seconds: float = opt(5.0, help="seconds each stage is measured")
    cache_dir: str | None = opt(option_default("cache_dir"), help="the loader's local cache of remote shards")
    read_concurrency: int = opt(option_default("read_concurrency"), help="remote row-group reads in flight")
    rank: int = opt(0, help="this rank, whose rows are read")
    world_size: int = opt(1, help="ranks sharing the channel")
    json: bool = opt(False, help="print the figures and the verdict as one JSON object")

    def __post_init__(self) -> None:
        if self.channel not in CHANNELS:
            raise ConfigError(f"channel must be one of {', '.join(CHANNELS)}, got {self.channel!r}")
        for name in ("batch_size", "read_concurrency", "world_size"):
            check_positive(name, getattr(self, name), error=ConfigError)
        for name in ("threads", "crop"):
            check_positive(name, getattr(self, name), allow_none=True, error=ConfigError)
        check_positive("rank", self.rank, allow_zero=True, error=ConfigError)
        if not self.rank < self.world_size:
            raise ConfigError(f"rank must be below world_size ({self.world_size}), got {self.rank!r}")
        if not 0 < self.seconds < math.inf:
            raise ConfigError(
                f"seconds must be a positive number, finite (each stage is measured that long), got {self.seconds!r}"
            )
        if self.transform is not None and (self.augment or self.crop is not None):
            raise ConfigError(
                f"transform {self.transform!r} and --augment/--crop both transform the batch: pass one of them"
            )

    @property
    def decode_threads(self) -> int:
        """``threads``, or the cores this process may use."""
        return self.threads if self.threads is not None else default_threads()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Find what bounds feeding a model on this machine: the store, decoding, the transform "
        "or the model, each measured alone and then together, and what to do next.",
        epilog="Exit status: 0 done; 2 bad input (one error line, before any measuring).",
    )
    add_arguments(parser, DoctorConfig)
    return parser


def parse_args(argv: list[str] | None = None) -> DoctorConfig:
    config = resolve(DoctorConfig, build_parser().parse_args(argv))
    if not config.dataset:
        raise ConfigError("dataset is required: pass --dataset URI")
    return config
