"""Training options: ``conf/train.yaml`` loaded into a frozen dataclass, overridable on the
command line. Precedence: the dataclass defaults < ``--conf FILE`` < command-line flags.

Every field's ``help`` (in its metadata) is the ``--help`` text of its flag; the YAML file
comments every key.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobs.errors import ConfigError

__all__ = ["OPTIMIZERS", "TrainConfig", "build_parser", "load_config", "parse_args"]

OPTIMIZERS = ("adamw", "sgd")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class TrainConfig:
    dataset: str | None = _opt(None, "dataset root (local path, file:// or s3://): the folder holding dataset.json")
    output: str = _opt("runs/default", "where rank 0 writes checkpoint.pt and metrics.json (path or URI)")
    epochs: int = _opt(5, "number of epochs to train")
    batch_size: int = _opt(256, "GLOBAL batch size, split evenly across ranks (must be divisible by the world size)")
    eval_batch_size: int = _opt(0, "per-rank batch size for validation/test; 0 = the per-rank training batch")
    lr: float = _opt(0.01, "learning rate")
    gamma: float = _opt(0.7, "StepLR decay: lr *= gamma every step_size epochs")
    step_size: int = _opt(1, "StepLR period, in epochs")
    optimizer: str = _opt("adamw", f"optimizer: one of {', '.join(OPTIMIZERS)}")
    momentum: float = _opt(0.9, "SGD momentum (ignored by AdamW)")
    weight_decay: float = _opt(0.01, "weight decay")
    width: int = _opt(32, "channels of the first convolution of the small CNN (doubling per block)")
    seed: int = _opt(7, "seed of model init, shuffling and augmentation")
    augment: bool = _opt(True, "random horizontal flips of training images")
    drop_last: bool = _opt(True, "drop each epoch's short last training batch (same on every rank)")
    num_threads: int = _opt(2, "decode threads per rank")
    prefetch: int = _opt(4, "batches each rank decodes ahead of the training step")
    shuffle_window: int = _opt(2048, "rows shuffled together by the loader (and its read-ahead memory bound)")
    skip_bad_rows: bool = _opt(False, "replace undecodable rows by ignored padding (counted, logged) instead of failing")
    checkpoint_every: int = _opt(0, "also checkpoint every N training steps (0 = at the end of each epoch only)")
    resume: str | None = _opt(None, "checkpoint to resume from; 'auto' = <output>/checkpoint.pt")
    dist_timeout: float = _opt(300.0, "seconds a collective may wait for the other ranks before failing")
    progress: bool = _opt(True, "show a tqdm progress bar on rank 0")

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "step_size", "width", "num_threads", "prefetch", "shuffle_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("eval_batch_size", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("lr", "dist_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def load_config(path: str | Path) -> dict[str, Any]:
    """The options set in a YAML file; unknown keys are an error naming the key and the file."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of options, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} in {path}; known: {sorted(_FIELDS)}")
    return data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loaders.train",
        description="Train a small CNN on a lakeshard dataset with DDP "
        "(python -m loaders.train ... or torchrun --nproc_per_node=N -m loaders.train ...).",
        epilog="Precedence: built-in defaults < --conf file < command-line flags.",
    )
    parser.add_argument("--conf", metavar="YAML", help="options file (see conf/train.yaml)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} (default: {f.default!r})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name == "resume":
            parser.add_argument(flag, nargs="?", const="auto", default=None, metavar="CHECKPOINT", help=help_text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=help_text)
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    conf = args.pop("conf")
    if conf:
        values.update(load_config(conf))
    values.update({k: v for k, v in args.items() if v is not None})
    config = TrainConfig(**values)
    if not config.dataset:
        raise ConfigError("dataset is required: pass --dataset URI or set 'dataset' in the --conf file")
    return config
