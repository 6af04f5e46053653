"""The doctor's options: a frozen dataclass whose fields are the command line
(:func:`lakeshard.settings.add_arguments`), as the trainer's ``TrainConfig`` is."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from lakeshard.errors import ConfigError
from lakeshard.settings import add_arguments, check_positive, command_name, opt, resolve
from loaders.options import check_loader_flags, default_threads, from_loader, loader_flags

__all__ = ["NOT_FLAGS", "PROG", "DoctorConfig", "build_parser", "parse_args"]

PROG = "python -m loaders.doctor"


#: The loader options that are no flag of the doctor, and why; every other option of
#: :data:`loaders.options.OPTIONS` is one, made from the option's row (``from_loader``).
NOT_FLAGS = {
    "num_threads": "--threads: the most decode threads measured (1, 2, 4, ... up to it)",
    "shuffle": "on, as in training",
    "seed": "0: the figures do not depend on it",
    "drop_last": "stages are measured for a time, not for an epoch",
    "remainder": "stages are measured for a time, not for an epoch",
    "pin_memory": "no copy to a GPU is measured",
    "skip_bad_rows": "a row that cannot be decoded is worth an error here",
    "decoder": "auto, the loader's own, is measured (and none for the store stage)",
    "normalize": "a Python object: a --transform can normalise",
    "collate": "a Python object; the stages are measured with the loader's own batches",
    "prep": "decoding is measured on this machine",
    "prep_timeout": "decoding is measured on this machine",
    "prep_fallback": "decoding is measured on this machine",
    "prep_security": "decoding is measured on this machine",
    "prices": "the doctor prices nothing",
    "cost_budget": "the doctor prices nothing",
    "on_budget": "the doctor prices nothing",
}


@dataclass(frozen=True, slots=True)
@loader_flags
class DoctorConfig:
    dataset: str | None = opt(
        None,
        help="dataset root (local path, file://, s3://, gs:// or az://): the folder holding dataset.json (required)",
    )
    channel: str = from_loader()
    model: str | None = opt(
        None,
        help="your model: package.module:factory, a callable (num_classes, image_size) -> torch.nn.Module "
        "returning [batch, num_classes] logits (default: the model is not measured)",
    )
    batch_size: int = from_loader()
    transform: str | None = from_loader()
    augment: bool = from_loader()
    crop: int | None = from_loader()
    threads: int | None = opt(
        None, help="decode threads, the cores decoding may use (default: the cores this process may use)"
    )
    seconds: float = opt(5.0, help="seconds each stage is measured")
    read_concurrency: int = from_loader()
    memory_budget: int | str | None = from_loader()
    cache_dir: str | None = from_loader()
    cache_limit: int | str = from_loader()
    prefetch: int = from_loader()
    shuffle_window: int = from_loader()
    rank: int = from_loader()
    world_size: int = from_loader()
    json: bool = opt(False, help="print the figures and the verdict as one JSON object")

    def __post_init__(self) -> None:
        check_loader_flags(self)
        check_positive("threads", self.threads, allow_none=True, error=ConfigError)
        check_positive("rank", self.rank, allow_zero=True, error=ConfigError)
        if not self.rank < self.world_size:
            raise ConfigError(
                f"rank must be below world_size ({self.world_size}), got {self.rank!r}", option="rank"
            )
        if not 0 < self.seconds < math.inf:
            raise ConfigError(
                f"seconds must be a positive number, finite (each stage is measured that long), got {self.seconds!r}",
                option="seconds",
            )
        if self.transform is not None and (self.augment or self.crop is not None):
            raise ConfigError(
                f"transform {self.transform!r} and --augment/--crop both transform the batch: pass one of them",
                option="transform",
            )

    @property
    def decode_threads(self) -> int:
        """``threads``, or the cores this process may use."""
        return self.threads if self.threads is not None else default_threads()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name(PROG),
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
