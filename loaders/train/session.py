"""What a training run's steps share (:class:`Run`) and how its parts are built: the rank's
loaders (:func:`open_loaders`), the model on its device and under DDP, its optimiser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loaders.mixed_loader import Concatenated, MixedLoader
from loaders.options import loader_values
from loaders.shard_loader import ShardLoader
from loaders.stats import PriceTable
from loaders.train.checks import EVAL_CHANNELS, TrainPlan
from loaders.train.config import TrainConfig, sources
from loaders.train.export import Exporter
from loaders.train.preemption import AgreedStop
from loaders.train.world import World

__all__ = ["Loaders", "Run", "make_optimizer", "on_device", "open_loaders", "wrap_ddp"]

#: Images are normalised to [-1, 1] by the loader's decode threads.
_NORMALIZE = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))

#: The loader options of the trainer's flags that only the training loader takes (the
#: validation and test loaders take the others).
_TRAIN_ONLY = ("augment", "drop_last", "prep", "prep_fallback", "prep_timeout", "on_budget")


@dataclass(frozen=True, slots=True)
class Loaders:
    """A rank's loaders; ``None`` for a channel the dataset does not have."""

    train: ShardLoader | MixedLoader
    validation: ShardLoader | Concatenated | None
    test: ShardLoader | Concatenated | None

    def close(self) -> None:
        for loader in (self.train, self.validation, self.test):
            if loader is not None:
                loader.close()


def open_loaders(cfg: TrainConfig, world: World, plan: TrainPlan) -> Loaders:
    flags = loader_values(cfg)  # the loader options of the trainer's flags, by name
    common: dict[str, Any] = dict(  # the options every loader takes
        rank=world.rank,
        world_size=world.world_size,
        seed=cfg.seed,
        normalize=_NORMALIZE,
        pin_memory=world.device.type == "cuda",
        prices=PriceTable(cfg.price_get_per_1000, cfg.price_transfer_per_gb),
        **{k: v for k, v in flags.items() if k not in _TRAIN_ONLY},
    )
    budget = None if cfg.cost_budget is None else cfg.cost_budget / world.world_size  # each rank's share
    train: dict[str, Any] = dict(
        channel="train",
        batch_size=plan.per_rank_batch,
        shuffle=True,
        cost_budget=budget,
        prep_security=(
            {"ca_file": cfg.prep_tls_ca_file, "cert": cfg.prep_tls_cert, "key": cfg.prep_tls_key}
            if cfg.prep_tls_cert
            else None
        ),
        **{k: flags[k] for k in _TRAIN_ONLY if k != "drop_last"},  # a mixture has no drop_last
        **common,
    )
    eval_batch = cfg.eval_batch_size or plan.per_rank_batch
    if isinstance(cfg.dataset, str):
        train_loader: ShardLoader | MixedLoader = ShardLoader(cfg.dataset, drop_last=cfg.drop_last, **train)
        val_loader, test_loader = (
            None
            if channel in plan.skipped
            else ShardLoader(cfg.dataset, channel=channel, batch_size=eval_batch, **common)
            for channel in EVAL_CHANNELS
        )
        return Loaders(train_loader, val_loader, test_loader)
    assert cfg.dataset is not None  # prepare() (the plan) refused a config without one
    mixed = [(uri, w) if w is not None else uri for uri, w in sources(cfg.dataset)]
    train_loader = MixedLoader(mixed, samples_per_epoch=cfg.samples_per_epoch or None, **train)
    labels = {name: i for i, name in enumerate(plan.class_names)}
    evals = []
    for channel in EVAL_CHANNELS:
        having = [src for src in train_loader.shard_sources if channel in src.info.channels]
        evals.append(
            None
            if channel in plan.skipped
            else Concatenated(
                [
                    ShardLoader(src.dataset, channel=channel, batch_size=eval_batch, **common)
                    for src in having
                ],
                labels,
            )
        )
    return Loaders(train_loader, *evals)


def on_device(model: nn.Module, world: World) -> nn.Module:
    """``model`` on this rank's device (in ``channels_last``, as the loader's images are, on CUDA)."""
    model = model.to(world.device)
    if world.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # Module.to takes it; torch's overloads omit it
    return model


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def wrap_ddp(model: nn.Module, world: World) -> nn.Module:
    """``model`` under DistributedDataParallel when there are several ranks (``model`` itself else)."""
    if not world.active:
        return model
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


@dataclass(frozen=True, slots=True)
class Run:
    """What the steps of a run share: the options, this rank's world, what the checks found, the
    loaders, the model (``ddp``: under DDP, or itself on one rank), its optimiser and scheduler,
    the agreed stop signal and ``metrics.json``'s epochs so far (appended as each ends)."""

    cfg: TrainConfig
    world: World
    plan: TrainPlan
    loaders: Loaders
    model: nn.Module
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.StepLR
    stop: AgreedStop
    history: list[dict[str, Any]]
    exporter: Exporter | None = None  # rank 0's, with --metrics-port or --tensorboard-dir

    @property
    def bf16(self) -> bool:
        return self.cfg.precision == "bf16"
