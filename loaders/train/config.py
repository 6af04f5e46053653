"""Training options: ``conf/train.yaml`` loaded into a frozen dataclass, overridable on the
command line. Precedence: the dataclass defaults < ``--conf FILE`` < command-line flags.

Every field's ``help`` (in its metadata) is the ``--help`` text of its flag; the YAML file
comments every key.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lakeshard import storage
from lakeshard.errors import ConfigError, StorageError
from lakeshard.settings import (
    MAX_SEED,
    add_arguments,
    check_positive,
    check_seed,
    command_name,
    opt,
    parse_option,
    parse_seed,
    read_yaml,
    resolve,
)
from loaders.mixed_loader import same_dataset
from loaders.options import check_loader_flags, from_loader, loader_flags
from loaders.stats import PriceTable
from loaders.train.model import MODEL_SPEC

__all__ = [
    "MAX_SEED",
    "NOT_FLAGS",
    "OPTIMIZERS",
    "OWN_DEFAULTS",
    "PRECISIONS",
    "TrainConfig",
    "build_parser",
    "load_config",
    "parse_args",
    "sources",
    "split_source",
]

OPTIMIZERS = ("adamw", "sgd")
#: ``bf16``: forward passes under ``torch.autocast(dtype=torch.bfloat16)`` (CUDA or CPU).
PRECISIONS = ("fp32", "bf16")

#: The default prices (the loader's): what ``--price-*`` default to.
_PRICES = PriceTable()

#: The loader options that are no flag of the trainer, and why; every other option of
#: :data:`loaders.options.OPTIONS` is one, made from the option's row (``from_loader``).
NOT_FLAGS = {
    "channel": "the trainer reads train, validation and test, a loader each",
    "rank": "the process's rank in the process group",
    "world_size": "the process group's size",
    "batch_size": "--batch-size is the global batch, split among the ranks",
    "shuffle": "training batches are shuffled, evaluation batches are not",
    "seed": "--seed also seeds the model's initial weights (from 0 to 2**32 - 1)",
    "remainder": "pad: every row is read, the loss ignores the padding",
    "pin_memory": "on with CUDA",
    "decoder": "auto: the model trains on decoded images",
    "transform": "the trainer's batches are augment's and normalize's; a transform of yours goes with a loop of yours",
    "collate": "a Python object; the trainer's batches are the loader's own",
    "crop": "the model takes the dataset's image size",
    "normalize": "(0.5, 0.5, 0.5) both: images in [-1, 1]",
    "prep_security": "--prep-tls-ca-file, --prep-tls-cert and --prep-tls-key make it",
    "prices": "--price-get-per-1000 and --price-transfer-per-gb make it",
    "cost_budget": "--cost-budget is an epoch's budget over all ranks, each rank's loader its share",
}

#: The loader options whose flags default to the trainer's choice, not the library's, and why.
OWN_DEFAULTS = {
    "augment": "training augments (--no-augment: not)",
    "drop_last": "every training step takes a whole global batch",
}


def split_source(item: str) -> tuple[str, float | None]:
    """``URI`` or ``URI:WEIGHT`` (a positive number after the last colon) as ``(URI, weight)``.

    Raises:
        ValueError: an empty URI or a weight that is not a positive number.
    """
    head, sep, tail = item.rpartition(":")
    if not sep or "/" in tail or not tail:
        return item, None
    try:
        weight = float(tail)
    except ValueError:
        return item, None  # a colon of the URI (s3://...), not a weight
    if not head or not weight > 0 or weight == float("inf"):
        raise ValueError(f"expected URI or URI:WEIGHT with a positive weight, got {item!r}")
    return head, weight


def _parse_datasets(raw: Any) -> str | tuple[str, ...]:
    """``--dataset`` (repeatable) / ``dataset:`` (a string or a list): one dataset root, or
    several ``URI[:WEIGHT]`` to mix (all weighted or none); one unweighted stays a string."""
    items = list(raw) if isinstance(raw, list | tuple) else [raw]
    if not items or not all(isinstance(i, str) and i.strip() for i in items):
        raise ValueError(f"expected a dataset URI, or several URI[:WEIGHT], got {raw!r}")
    if len(items) == 1 and _is_local_path(items[0]):
        return items[0]  # a folder named run-12:30 is a path, not run-12 weighing 30
    weights = [split_source(i)[1] for i in items]
    if len(items) == 1 and weights[0] is None:
        return items[0]
    if any(w is None for w in weights) and not all(w is None for w in weights):
        raise ValueError(
            f"give every dataset a weight (URI:WEIGHT) or none (each weighs its rows), got {items}"
        )
    twice = same_dataset([split_source(i)[0] for i in items])
    if twice is not None:
        first, second, root = twice
        raise ValueError(
            f"{items[first]!r} and {items[second]!r} are the same dataset, {root}: give each dataset once "
            "(sum its weights)"
        )
    return tuple(items)


def _is_local_path(item: str) -> bool:
    """``item`` names an existing local file or folder as given (a plain path or ``file://``)."""
    try:
        return storage.is_local(item) and os.path.exists(storage.local_path(item))
    except StorageError:  # not a URI this package reads: not a path either
        return False


def sources(dataset: str | tuple[str, ...]) -> list[tuple[str, float | None]]:
    """The ``(URI, weight)`` of each dataset of ``TrainConfig.dataset``."""
    if isinstance(dataset, str):
        return [(dataset, None)]
    return [split_source(item) for item in dataset]


def _parse_model(raw: Any) -> str:
    """``--model`` / ``model:`` is ``package.module:factory`` (imported and called later, by
    :func:`loaders.train.model.build_model`)."""
    if not isinstance(raw, str) or not MODEL_SPEC.fullmatch(raw):
        raise ValueError(
            f"expected package.module:factory, a callable (num_classes, image_size) -> torch.nn.Module, got {raw!r}"
        )
    return raw


def _parse_resume(raw: Any) -> str:
    """``--resume`` / ``resume:`` is a checkpoint path or ``auto``; YAML's ``true`` is neither (it
    would otherwise become the path ``./True``)."""
    if not isinstance(raw, str) or not raw:
        raise ValueError(
            f"expected a checkpoint path or 'auto', got {raw!r} (write 'resume: auto' to resume from "
            "<output>/checkpoint.pt when there is one, or 'resume: null' to start afresh)"
        )
    return raw


@dataclass(frozen=True, slots=True)
@loader_flags
class TrainConfig:
    dataset: str | tuple[str, ...] | None = opt(
        None,
        repeat=True,
        parse=_parse_datasets,
        help="dataset root (local path, file://, s3://, gs:// or az://): the folder holding dataset.json; "
        "several (URI:WEIGHT each, or no weights: each weighs its rows) train on their mixture, "
        "each an exact share of every epoch; one --dataset that exists as given is that path, colons and all",
    )
    samples_per_epoch: int = opt(
        0,
        help="with several datasets: training samples per epoch over all ranks, rounded down to whole "
        "global batches (0 = the rows of all their train channels); refused with one dataset",
    )
    output: str = opt(
        "runs/default",
        help="where rank 0 writes checkpoint.pt and metrics.json (path or "
        "URI); checked writable (a probe file) before training",
    )
    epochs: int = opt(5, help="number of epochs to train")
    batch_size: int = opt(
        256, help="GLOBAL batch size, split evenly across ranks (must be divisible by the world size)"
    )
    eval_batch_size: int = opt(
        0, help="per-rank batch size for validation/test; 0 = the per-rank training batch"
    )
    lr: float = opt(0.01, help="learning rate")
    gamma: float = opt(0.7, help="StepLR decay: lr *= gamma every step_size epochs")
    step_size: int = opt(1, help="StepLR period, in epochs")
    optimizer: str = opt("adamw", choices=OPTIMIZERS, help="optimizer (a resumed run keeps its checkpoint's)")
    momentum: float = opt(0.9, help="SGD momentum (ignored by AdamW)")
    weight_decay: float = opt(0.01, help="weight decay")
    width: int = opt(
        32,
        help="channels of the first convolution of the small CNN (doubling per block); "
        "a resumed run keeps its checkpoint's",
    )
    model: str | None = opt(
        None,
        parse=_parse_model,
        help="your own model: package.module:factory, a callable (num_classes, image_size) -> "
        "torch.nn.Module returning [batch, num_classes] logits, checked by one forward "
        "pass before training (default: the small CNN; a resumed run keeps its "
        "checkpoint's)",
    )
    precision: str = opt(
        "fp32",
        choices=PRECISIONS,
        help="fp32, or bf16: forward passes under torch.autocast(bfloat16), on CUDA or CPU",
    )
    seed: int = opt(
        7, parse=parse_seed, help=f"seed of model init, shuffling and augmentation (0 to {MAX_SEED})"
    )
    # The loader's options (loaders.options.OPTIONS: flag, YAML key, default, help and check); the
    # trainer's own defaults where OWN_DEFAULTS says so.
    augment: bool = from_loader(default=True, help="random horizontal flips of training images")
    drop_last: bool = from_loader(default=True)
    num_threads: int | None = from_loader()
    prefetch: int = from_loader()
    shuffle_window: int = from_loader()
    read_concurrency: int = from_loader()
    memory_budget: int | str | None = from_loader()
    cache_dir: str | None = from_loader()
    cache_limit: int | str = from_loader()
    skip_bad_rows: bool = from_loader()
    checkpoint_every: int = opt(
        0,
        help="also checkpoint every N training steps (0 = at the end of each "
        "epoch only); SIGTERM or SIGUSR1 also saves one, after the current step, and "
        "exits with status 75",
    )
    resume: str | None = opt(
        None,
        const="auto",
        parse=_parse_resume,
        help="checkpoint to resume from; 'auto' (or no value) = <output>/checkpoint.pt if it "
        "exists, else a fresh run (rerun a run that exited 75 with it)",
    )
    prep: str | None = from_loader()
    prep_fallback: bool = from_loader()
    prep_timeout: float = from_loader()
    prep_tls_ca_file: str | None = opt(
        None, help="with --prep tls://...: the CA (PEM) the preparation cluster's certificates are signed by"
    )
    prep_tls_cert: str | None = opt(
        None, help="with --prep tls://...: this trainer's client certificate (PEM), signed by that CA"
    )
    prep_tls_key: str | None = opt(None, help="with --prep tls://...: the key (PEM) of --prep-tls-cert")
    metrics_port: int | None = opt(
        None,
        help="serve each epoch's figures (images/s, data wait, requests, bytes, cost, straggler, shuffle) as "
        "Prometheus metrics on this port of rank 0's machine (0: any free port; needs prometheus-client)",
    )
    metrics_host: str = opt(
        "127.0.0.1",
        help="with --metrics-port: the address the metrics are served on; 127.0.0.1 (this machine only) by "
        "default; an interface's address, 0.0.0.0 or :: (every interface) lets another machine scrape them",
    )
    tensorboard_dir: str | None = opt(
        None,
        help="also write each epoch's figures as TensorBoard scalars here (needs tensorboard); "
        "checked writable (a probe file) before training",
    )
    cost_budget: float | None = opt(
        None,
        help="US dollars an epoch's store reads may cost over all ranks (estimated with the prices below); "
        "past it, --on-budget",
    )
    on_budget: str = from_loader()
    price_get_per_1000: float = opt(
        _PRICES.get_per_1000, help="US dollars per 1,000 GET requests (default: S3 Standard, us-east-1)"
    )
    price_transfer_per_gb: float = opt(
        _PRICES.transfer_per_gb,
        help="US dollars per GB read from the store (default: S3 transfer out of the region; 0 within the bucket's region)",
    )
    dist_timeout: float = opt(300.0, help="seconds a collective may wait for the other ranks before failing")
    progress: bool = opt(
        True,
        help="show a tqdm progress bar on rank 0 when stderr is a terminal (a log gets one line per epoch)",
    )

    def __post_init__(self) -> None:
        check_loader_flags(self)
        for name in ("epochs", "batch_size", "step_size", "width"):
            check_positive(name, getattr(self, name), error=ConfigError)
        if self.dataset is not None:
            given = list(self.dataset) if isinstance(self.dataset, tuple) else self.dataset
            parse_option("dataset", _parse_datasets, given)
        for name in ("eval_batch_size", "checkpoint_every", "samples_per_epoch"):
            check_positive(name, getattr(self, name), allow_zero=True, error=ConfigError)
        check_seed("seed", self.seed)
        if self.samples_per_epoch and isinstance(self.dataset, str):
            raise ConfigError(
                f"samples_per_epoch {self.samples_per_epoch} applies to a mixture (several datasets, or "
                f"one given as URI:WEIGHT); an epoch of the one dataset {self.dataset} is its train channel: "
                "drop it",
                option="samples_per_epoch",
            )
        for name, parse in (("resume", _parse_resume), ("model", _parse_model)):
            if getattr(self, name) is not None:
                parse_option(name, parse, getattr(self, name))
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {PRECISIONS}, got {self.precision!r}", option="precision"
            )
        tls = {"ca_file": self.prep_tls_ca_file, "cert": self.prep_tls_cert, "key": self.prep_tls_key}
        if any(tls.values()) and (not all(tls.values()) or not (self.prep or "").startswith("tls://")):
            raise ConfigError(
                "prep_tls_ca_file, prep_tls_cert and prep_tls_key go together, with a prep address "
                f"tls://host:port; got prep={self.prep!r}, "
                + ", ".join(f"prep_tls_{k}={v!r}" for k, v in tls.items())
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"metrics_port must be in [0, 65535] (0: any free port), got {self.metrics_port!r}",
                option="metrics_port",
            )
        if not isinstance(self.metrics_host, str) or not self.metrics_host.strip():
            raise ConfigError(
                f"metrics_host must be an address such as 127.0.0.1, 0.0.0.0 or ::, got {self.metrics_host!r}",
                option="metrics_host",
            )
        self._check_cost()
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}", option="optimizer"
            )
        for name in ("lr", "dist_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}", option=name)
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma!r}", option="gamma")

    def _check_cost(self) -> None:
        """The budget is positive (or unset), the prices it is estimated with non-negative."""
        if self.cost_budget is not None and not self.cost_budget > 0:
            raise ConfigError(
                f"cost_budget must be a positive number of US dollars, got {self.cost_budget!r}",
                option="cost_budget",
            )
        for name in ("price_get_per_1000", "price_transfer_per_gb"):
            if not getattr(self, name) >= 0:
                raise ConfigError(
                    f"{name} must be a non-negative number of US dollars, got {getattr(self, name)!r}",
                    option=name,
                )


def load_config(path: str | Path) -> dict[str, Any]:
    """The options set in a YAML file; an unknown key is an error naming the key and the file."""
    return read_yaml(str(path), TrainConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name("python -m loaders.train"),
        description="Train a small CNN on a lakeshard dataset with DDP "
        "(python -m loaders.train ... or torchrun --nproc_per_node=N -m loaders.train ...).",
        epilog="Precedence: built-in defaults < --conf file (conf/train.yaml) < command-line flags. "
        "Exit status: 0 done; 2 bad input (one error line, before any work); 75 stopped by SIGTERM or SIGUSR1 "
        "after saving a checkpoint (rerun with --resume auto to continue).",
    )
    add_arguments(parser, TrainConfig)
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    config = resolve(TrainConfig, build_parser().parse_args(argv))
    if not config.dataset:
        raise ConfigError("dataset is required: pass --dataset URI or set 'dataset' in the --conf file")
    return config
