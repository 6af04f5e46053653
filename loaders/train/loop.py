"""Train a small CNN (or your model) on a lakeshard dataset with DistributedDataParallel.

```
python -m loaders.train --dataset <URI> --epochs 5 --batch-size 256 --lr 0.01 --gamma 0.7 --output runs/pets
torchrun --nproc_per_node=2 -m loaders.train --dataset <URI> --conf conf/train.yaml ...
```

One process per rank (gloo on CPU, nccl with CUDA). Each rank streams its share of the train
channel with a :class:`~loaders.ShardLoader`; every epoch ends with the validation accuracy
(all ranks, all-reduced: top-1 and per class), and training ends with the test accuracy. Rank 0
writes ``<output>/checkpoint.pt`` (model, optimiser, scheduler, loader state, dataset version,
metrics so far) and ``<output>/metrics.json`` (per epoch: loss, validation accuracy, images/s,
each rank's share of step time spent waiting for data, the real samples trained on and the
world sizes the epoch ran at; see ``docs/training.md``).

The model is a :class:`~loaders.train.model.SmallCNN`, or yours with ``--model package.module:factory``
(:func:`~loaders.train.model.build_model`). ``--precision bf16`` runs the forward passes under
``torch.autocast(dtype=torch.bfloat16)``, on CUDA or on CPU; on CUDA the model is in
``channels_last`` memory format, as the loader's images are.

``--resume PATH`` continues from a checkpoint, mid-epoch included; ``--resume auto`` resumes
from ``<output>/checkpoint.pt`` if there is one and starts afresh otherwise, so a preemptible job
reruns one command line. The checkpoint may come from another number of ranks: the global
``--batch-size`` stays the same (it must divide by the new world size) and the rest of the
interrupted epoch is dealt to the new ranks, every sample exactly once (:mod:`loaders._internal.elastic`);
its ``samples`` in ``metrics.json`` count the epoch's real rows before and after the resume.

SIGTERM (a spot reclaim, Kubernetes, Slurm, torchrun forwarding its own) or SIGUSR1 (Slurm's
``--signal`` warning), to any of the ranks, stops the run after the current step: the ranks agree
on the step (one all-reduce per training step and evaluation batch), rank 0 saves a mid-epoch
checkpoint (the state a ``--checkpoint-every`` checkpoint has; during an evaluation, the epoch's
trained state before it), logs one line saying where and how to resume, and every rank exits
with status 75 (:data:`~loaders.train.preemption.EXIT_PREEMPTED`); ``--resume auto`` then trains every
remaining sample exactly once (:mod:`loaders.train.preemption`).

A dataset without a validation (or test) channel trains without that evaluation: the log says
so, and ``metrics.json`` has ``null`` accuracies and the reason under ``skipped``.

Bad input (options, environment, dataset, checkpoint, a resume with another ``--model``,
``--width`` or ``--optimizer``, a model whose output does not fit the data, an ``--output`` that
cannot be written) is checked on every rank before the process group starts and before any
loader thread (:mod:`loaders.train.checks`); :func:`main` prints it as one
``python -m loaders.train: error: ...`` line and returns 2, with no traceback. The progress bar is drawn on a terminal only; a log gets the line
each epoch ends with.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from lakeshard import storage
from lakeshard.errors import ConfigError, PlatformError, StorageError
from loaders._internal.state import last_leg
from loaders.batch import PAD_LABEL
from loaders.mixed_loader import Concatenated, MixedLoader
from loaders.options import loader_values
from loaders.shard_loader import ShardLoader, default_threads
from loaders.stats import PriceTable, usd
from loaders.train.checks import EVAL_CHANNELS, TrainPlan, prepare
from loaders.train.config import TrainConfig, parse_args, sources
from loaders.train.evaluation import Accuracy, evaluate
from loaders.train.export import EpochFigures, Exporter
from loaders.train.metrics import EpochRecord, EpochTotals, LoaderSummary, find_straggler
from loaders.train.preemption import EXIT_PREEMPTED, Preempted, StopRequest, signal_name, stop_signals
from loaders.train.world import Ranks, World, all_gather, all_reduce, any_rank, gather

__all__ = ["main", "train"]

log = logging.getLogger(__name__)

_PROG = "python -m loaders.train"

#: Images are normalised to [-1, 1] by the loader's decode threads.
_NORMALIZE = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))

#: The loader options of the trainer's flags that only the training loader takes (the
#: validation and test loaders take the others).
_TRAIN_ONLY = ("augment", "drop_last", "prep", "prep_fallback", "prep_timeout", "on_budget")


def _init_distributed(cfg: TrainConfig, ranks: Ranks) -> World:
    """This process's device (its local GPU, else the CPU), in the process group when there are
    several ranks or torchrun started it."""
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{ranks.local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    grouped = ranks.world_size > 1 or ranks.launched
    if grouped:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
        log.info("rank %d/%d joined the %s process group", ranks.rank, ranks.world_size, backend)
    return World(ranks.rank, ranks.world_size, ranks.local_rank, ranks.local_world_size, device, grouped)


def _info_level(world: World) -> int:
    """What every rank does alike is logged by rank 0 (the others log it at DEBUG)."""
    return logging.INFO if world.rank == 0 else logging.DEBUG


class _Stop:
    """The stop signal the ranks agree on (NOTE [ Stopping on a signal ] in
    :mod:`loaders.train.preemption`): :meth:`agreed` is a collective, which every rank calls at
    the same points, after each training step, evaluation batch and epoch."""

    def __init__(self, request: StopRequest, world: World, checkpoint_uri: str) -> None:
        self._request, self._world, self._checkpoint_uri = request, world, checkpoint_uri
        self.signum = 0  # the largest signal any rank had received when last agreed; 0 for none

    def agreed(self) -> bool:
        """Whether any rank has received a stop signal (:attr:`signum`: the largest)."""
        signum = self._request.signum
        if self._world.active:
            (largest,) = all_reduce([float(signum)], self._world, maximum=True)
            signum = int(largest)
        self.signum = signum
        return self.signum != 0

    def preempted(self, where: str) -> Preempted:
        """Once rank 0 has saved the checkpoint (every rank waits for it: torchrun stops the
        others as soon as one rank exits), the exception that ends the run."""
        all_reduce([0.0], self._world)
        message = (
            f"{signal_name(self.signum)}: saved the checkpoint {self._checkpoint_uri} {where}; "
            f"exiting with status {EXIT_PREEMPTED}: rerun with --resume auto to continue"
        )
        log.log(logging.WARNING if self._world.rank == 0 else logging.DEBUG, "%s", message)
        return Preempted(message, signum=self.signum, checkpoint=self._checkpoint_uri)


@dataclass(frozen=True, slots=True)
class _Loaders:
    """A rank's loaders; ``None`` for a channel the dataset does not have."""

    train: ShardLoader | MixedLoader
    validation: ShardLoader | Concatenated | None
    test: ShardLoader | Concatenated | None

    def close(self) -> None:
        for loader in (self.train, self.validation, self.test):
            if loader is not None:
                loader.close()


def _loaders(cfg: TrainConfig, world: World, plan: TrainPlan) -> _Loaders:
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
        return _Loaders(train_loader, val_loader, test_loader)
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
    return _Loaders(train_loader, *evals)


def _on_device(model: nn.Module, world: World) -> nn.Module:
    """``model`` on this rank's device (in ``channels_last``, as the loader's images are, on CUDA)."""
    model = model.to(world.device)
    if world.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # Module.to takes it; torch's overloads omit it
    return model


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _ddp(model: nn.Module, world: World) -> nn.Module:
    """``model`` under DistributedDataParallel when there are several ranks (``model`` itself else)."""
    if not world.active:
        return model
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


@dataclass(frozen=True, slots=True)
class _Start:
    """Where a run starts: the epoch, its totals a mid-epoch checkpoint saved (none for an
    epoch's start), and ``metrics.json``'s epochs before it."""

    epoch: int
    carried: EpochTotals
    history: list[dict[str, Any]]


def _resume(
    cfg: TrainConfig,
    world: World,
    plan: TrainPlan,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.StepLR,
    loader: ShardLoader | MixedLoader,
) -> _Start:
    """The optimiser's, the scheduler's and the training loader's state as the checkpoint saved
    them, and where the run goes on; epoch 0 without a checkpoint."""
    ckpt = plan.checkpoint
    if ckpt is None:
        if cfg.resume == "auto":
            log.log(
                _info_level(world),
                "--resume auto: no checkpoint at %s, starting a fresh run",
                plan.checkpoint_uri,
            )
        return _Start(0, EpochTotals(), [])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    loader.load_state_dict(ckpt["loader"])
    epoch, step = ckpt["loader"]["epoch"], ckpt["loader"]["batches_consumed"]
    carried = EpochTotals()
    if ckpt.get("epoch_done"):
        epoch, step = epoch + 1, 0
    elif (ckpt.get("epoch_partial") or {}).get("epoch") == epoch:
        carried = EpochTotals.from_checkpoint(ckpt["epoch_partial"])
    saved = last_leg(ckpt["loader"])
    log.info(
        "resumed from %s at epoch %d, step %d (saved on %d rank(s) x %d rows, now %d x %d)",
        plan.resume_uri,
        epoch,
        step,
        saved.world_size,
        saved.batch_size,
        world.world_size,
        plan.per_rank_batch,
    )
    return _Start(epoch, carried, list(ckpt["metrics"]))


@dataclass(frozen=True, slots=True)
class _Run:
    """What the steps of a run share: the options, this rank's world, what the checks found, the
    loaders, the model (``ddp``: under DDP, or itself on one rank), its optimiser and scheduler,
    the agreed stop signal and ``metrics.json``'s epochs so far (appended as each ends)."""

    cfg: TrainConfig
    world: World
    plan: TrainPlan
    loaders: _Loaders
    model: nn.Module
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.StepLR
    stop: _Stop
    history: list[dict[str, Any]]
    exporter: Exporter | None = None  # rank 0's, with --metrics-port or --tensorboard-dir

    @property
    def bf16(self) -> bool:
        return self.cfg.precision == "bf16"


def train(cfg: TrainConfig, world: World, plan: TrainPlan | None = None) -> dict[str, Any]:
    """Run the training; return the metrics (also written to ``<output>/metrics.json``).

    ``plan``: what :func:`~loaders.train.checks.prepare` checked (run here when not given).

    Raises:
        Preempted: SIGTERM or SIGUSR1 reached a rank (while this runs in the main thread):
            every rank stopped after the same step, rank 0 saved the checkpoint to resume from.
    """
    plan = plan or prepare(cfg, world.world_size)
    torch.set_num_threads(default_threads(world.local_world_size))  # this rank's share of its CPUs
    for channel, reason in plan.skipped.items():
        what = "validation after each epoch" if channel == "validation" else "the final test"
        log.log(_info_level(world), "skipping %s: %s", what, reason)
    loaders = _loaders(cfg, world, plan)
    exporter: Exporter | None = None
    try:
        exporter = _exporter(cfg, world)
        with stop_signals() as request:
            return _train(cfg, world, plan, loaders, request, exporter)
    finally:
        loaders.close()
        if exporter is not None:
            exporter.close()


def _exporter(cfg: TrainConfig, world: World) -> Exporter | None:
    """The exporter of ``--metrics-port`` / ``--tensorboard-dir`` (rank 0 serves; every rank
    checks the packages), agreed on by every rank: one rank failing to start it (a port in use)
    stops them all with its error line, rather than leaving the others to wait for it."""
    if cfg.metrics_port is None and cfg.tensorboard_dir is None:
        return None
    exporter, error = None, None
    try:
        exporter = Exporter(
            port=cfg.metrics_port, tensorboard_dir=cfg.tensorboard_dir, rank=world.rank, addr=cfg.metrics_host
        )
    except PlatformError as exc:
        error = exc
    failed = any_rank(error is not None, world)
    if error is not None:
        raise error
    assert exporter is not None  # no error: this rank's started
    if failed:
        exporter.close()
        raise ConfigError("another rank could not start the metrics exporter (its line says why)")
    return exporter


def _train(
    cfg: TrainConfig,
    world: World,
    plan: TrainPlan,
    loaders: _Loaders,
    request: StopRequest,
    exporter: Exporter | None = None,
) -> dict[str, Any]:
    """Set up, resume, then train, validate, record and checkpoint each epoch; test at the end."""
    model = _on_device(plan.model, world)  # holds the checkpoint's weights when resuming
    optimizer = _optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    start = _resume(cfg, world, plan, optimizer=optimizer, scheduler=scheduler, loader=loaders.train)
    run = _Run(
        cfg,
        world,
        plan,
        loaders,
        model,
        _ddp(model, world),
        optimizer,
        scheduler,
        _Stop(request, world, plan.checkpoint_uri),
        start.history,
        exporter,
    )
    carried = start.carried
    for epoch in range(start.epoch, cfg.epochs):
        trained = _train_epoch(run, epoch, carried)
        carried = EpochTotals()
        validation = _validate(run, epoch, trained)
        run.scheduler.step()  # after the validation: a checkpoint saved during it holds the epoch's scheduler
        _record_epoch(run, epoch, trained, validation)
        _save_checkpoint(run, epoch_done=True)
        _write_metrics(run)
        if run.stop.agreed():  # a signal between two epochs: the checkpoint just saved resumes the next
            raise run.stop.preempted(f"after epoch {epoch}")
    return _test(run)


class _BatchLoss(NamedTuple):
    """A batch's mean loss over its real rows, and how many there are."""

    mean: torch.Tensor
    rows: int


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> _BatchLoss:
    """Mean cross-entropy over rows that count (padding is labelled PAD_LABEL)."""
    valid = int((labels != PAD_LABEL).sum())
    if valid == 0:  # keep the graph (DDP needs every parameter's gradient), contribute nothing
        return _BatchLoss(logits.sum() * 0.0, 0)
    return _BatchLoss(F.cross_entropy(logits, labels, ignore_index=PAD_LABEL, reduction="sum") / valid, valid)


@dataclass(frozen=True, slots=True)
class _Step:
    """A training step's mean loss (what the progress bar shows) and its totals."""

    loss: float
    totals: EpochTotals


def _step(run: _Run, images: torch.Tensor, labels: torch.Tensor) -> _Step:
    """One forward and backward pass and optimiser step on a batch."""
    images = images.to(run.world.device, non_blocking=True)
    labels = labels.to(run.world.device, non_blocking=True)
    with run.world.autocast(run.bf16):
        loss = _loss(run.ddp(images), labels)
    run.optimizer.zero_grad(set_to_none=True)
    loss.mean.backward()
    run.optimizer.step()
    value = float(loss.mean.detach())
    return _Step(value, EpochTotals(value * loss.rows, loss.rows, len(labels)))


@dataclass(frozen=True, slots=True)
class _Trained:
    """An epoch's training steps over every rank: their totals since the epoch began (before a
    resume included), the images of this run's steps, the slowest rank's seconds, each rank's
    share of step time spent waiting for data, the step this run began at and the epoch's steps."""

    totals: EpochTotals
    images_this_run: int
    seconds: float
    data_wait_share: list[float]
    first_step: int
    steps: int
    loader: list[dict[str, Any]]  # each rank's loaders.stats.LoaderStats, as JSON


def _train_epoch(run: _Run, epoch: int, carried: EpochTotals) -> _Trained:
    """Epoch ``epoch``'s training steps, from the one a restored state resumes at (``carried``:
    the totals its checkpoint saved). A checkpoint every ``--checkpoint-every`` steps; a stop
    signal saves one after the step and raises :class:`Preempted`."""
    loader, world, every = run.loaders.train, run.world, run.cfg.checkpoint_every
    loader.set_epoch(epoch)
    first_step, steps = loader.state_dict()["batches_consumed"], len(loader)
    run.ddp.train()
    here, wait, compute = EpochTotals(), 0.0, 0.0
    # A bar on a terminal; a log (not a terminal) gets the line each epoch ends with instead.
    show_bar = world.rank == 0 and run.cfg.progress and sys.stderr.isatty()
    epoch_start = tick = time.perf_counter()
    with tqdm(total=steps, initial=first_step, desc=f"epoch {epoch}", disable=not show_bar) as bar:
        for step, (images, labels) in enumerate(loader, start=first_step):
            got = time.perf_counter()
            wait += got - tick
            done = _step(run, images, labels)
            here += done.totals
            tick = time.perf_counter()
            compute += tick - got
            bar.update(1)
            bar.set_postfix(loss=f"{done.loss:.3f}")
            stopped = run.stop.agreed()
            if stopped or (every and (step + 1) % every == 0 and step + 1 < steps):
                so_far = here.all_reduce(world) + carried
                _save_checkpoint(run, epoch_done=False, partial=so_far.to_checkpoint(epoch))
            if stopped:
                raise run.stop.preempted(f"at epoch {epoch}, step {step + 1} of {steps}")
    elapsed = time.perf_counter() - epoch_start
    everyone = here.all_reduce(world)
    (slowest,) = all_reduce([elapsed], world, maximum=True)
    shares = all_gather(wait / (wait + compute) if wait + compute > 0 else 0.0, world)
    stats = gather(loader.epoch_stats().to_json(), world)
    return _Trained(everyone + carried, everyone.images, slowest, shares, first_step, steps, stats)


def _source_rows(run: _Run, loader: ShardLoader | MixedLoader) -> list[dict[str, Any]] | None:
    """A mixture's sources: each one's weight, its planned rows an epoch and the rows this run
    took from it (all ranks); ``None`` for one dataset."""
    if not isinstance(loader, MixedLoader):
        return None
    took = all_reduce([float(n) for n in loader.source_rows], run.world)
    return [
        {"dataset": uri, "weight": w, "planned_rows": planned, "rows": int(n)}
        for uri, w, planned, n in zip(loader.sources, loader.weights, loader.per_source, took, strict=True)
    ]


def _validate(run: _Run, epoch: int, trained: _Trained) -> Accuracy | None:
    """The validation accuracy after epoch ``epoch`` (None without the channel). A stop signal
    saves the epoch as it was before its validation and raises :class:`Preempted`."""
    loader = run.loaders.validation
    if loader is None:
        return None
    accuracy = evaluate(
        run.model, loader, run.world, run.plan.class_names, bf16=run.bf16, stop=run.stop.agreed
    )
    if accuracy is None:
        _save_checkpoint(run, epoch_done=False, partial=trained.totals.to_checkpoint(epoch))
        steps = trained.steps
        raise run.stop.preempted(f"at epoch {epoch}, step {steps} of {steps} (before its validation)")
    return accuracy


def _record_epoch(run: _Run, epoch: int, trained: _Trained, validation: Accuracy | None) -> EpochRecord:
    """Epoch ``epoch``'s record, appended to the run's epochs and logged as the line it ends with."""
    loader = run.loaders.train
    summary = _loader_summary(trained)
    record = EpochRecord(
        epoch=epoch,
        loss=trained.totals.loss,
        validation=validation,
        images_per_s=trained.images_this_run / trained.seconds if trained.seconds > 0 else 0.0,
        data_wait_share=trained.data_wait_share,
        steps=trained.steps - trained.first_step,
        resumed_at_step=trained.first_step,
        samples=trained.totals.samples,
        images=trained.totals.images,
        legs=loader.state_dict()["legs"],
        lr=float(run.scheduler.get_last_lr()[0]),  # a float, or a one-element tensor for a tensor lr
        seconds=trained.seconds,
        skipped_rows=len(loader.skipped_rows),
        sources=_source_rows(run, loader),
        loader=summary,
    )
    run.history.append(record.to_json())
    log.log(
        _info_level(run.world),
        "epoch %d: loss %s, validation accuracy %s, %.0f images/s, data wait %s, %d requests, %.1f MB read, %s",
        epoch,
        "n/a" if record.loss is None else f"{record.loss:.4f}",
        "n/a" if record.val_accuracy is None else f"{record.val_accuracy:.4f}",
        record.images_per_s,
        [f"{s:.0%}" for s in record.data_wait_share],
        summary.total("requests"),
        summary.total("bytes_read") / 1e6,
        usd(summary.total("cost_usd")),
    )
    if summary.straggler_line is not None and run.world.rank == 0:
        log.warning("epoch %d: straggler: %s", epoch, summary.straggler_line)
    if run.exporter is not None:
        run.exporter.epoch(_figures(record, summary))
    return record


def _figures(record: EpochRecord, summary: LoaderSummary) -> EpochFigures:
    """An epoch's record (its training loader's statistics: ``summary``) as the exporter takes it."""
    ranks = summary.per_rank
    shuffle = ranks[0].get("shuffle") or {}
    return EpochFigures(
        epoch=record.epoch,
        images_per_s=record.images_per_s,
        loss=record.loss,
        val_accuracy=record.val_accuracy,
        data_wait_share=record.data_wait_share,
        requests=[r["requests"] for r in ranks],
        bytes_read=[r["bytes_read"] for r in ranks],
        cache_bytes=[r["cache_bytes"] for r in ranks],
        retries=[r["retries"] for r in ranks],
        cost_usd=summary.total("cost_usd"),
        read_ms_mean=[r["read_ms_mean"] for r in ranks],
        shuffle_rank_correlation=shuffle.get("rank_correlation"),
        same_group_share=shuffle.get("same_group_share"),
        straggler=summary.straggler,
    )


def _loader_summary(trained: _Trained) -> LoaderSummary:
    read_ms = [r["read_ms_mean"] for r in trained.loader]
    found = find_straggler(trained.data_wait_share, read_ms)
    rank, line = found if found is not None else (None, None)
    return LoaderSummary(trained.loader, rank, line)


def _save_checkpoint(run: _Run, *, epoch_done: bool, partial: dict[str, Any] | None = None) -> None:
    """Rank 0 saves the checkpoint; ``partial``: an unfinished epoch's totals so far
    (:meth:`EpochTotals.to_checkpoint`). Every rank learns whether the save worked (a
    collective): a failed save stops every rank with an error line, where rank 0 failing alone
    would leave the others waiting in their next all-reduce until ``--dist-timeout``, or exiting
    75 as if the checkpoint they stopped for were saved."""
    error: Exception | None = None
    if run.world.rank == 0:
        try:
            _write_checkpoint(run, epoch_done=epoch_done, partial=partial)
        except Exception as exc:
            error = exc
    failed = any_rank(error is not None, run.world)
    if error is not None:
        if isinstance(error, PlatformError):
            raise error
        raise StorageError(
            f"cannot save the checkpoint {run.plan.checkpoint_uri}: {type(error).__name__}: {error}"
        ) from error
    if failed:
        raise StorageError(
            f"rank 0 could not save the checkpoint {run.plan.checkpoint_uri} (its line says why)"
        )


def _write_checkpoint(run: _Run, *, epoch_done: bool, partial: dict[str, Any] | None) -> None:
    buf = io.BytesIO()
    torch.save(
        {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "loader": run.loaders.train.state_dict(),
            "dataset_version": run.plan.dataset_version,
            "epoch_done": epoch_done,
            "epoch_partial": partial,
            "metrics": run.history,
            "config": asdict(run.cfg),
        },
        buf,
    )
    storage.write_bytes_atomic(run.plan.checkpoint_uri, buf.getvalue())


def _write_metrics(run: _Run, **final: Any) -> dict[str, Any]:
    """``metrics.json`` (rank 0 writes it): the run, its epochs so far and, at the end, the test
    (``final``)."""
    cfg = run.cfg
    metrics = {
        "dataset": cfg.dataset,
        "dataset_version": run.plan.dataset_version,
        "world_size": run.world.world_size,
        "global_batch_size": cfg.batch_size,
        "config": asdict(cfg),
        "skipped": run.plan.skipped,
        "epochs": run.history,
        **final,
    }
    if run.world.rank == 0:
        storage.write_json_atomic(run.plan.metrics_uri, metrics)
    return metrics


def _test(run: _Run) -> dict[str, Any]:
    """The final test (if the dataset has a test channel), and the metrics with it. A stop signal
    raises :class:`Preempted`: the last epoch's checkpoint resumes the test."""
    loader = run.loaders.test
    if loader is None:
        return _write_metrics(run, test_accuracy=None, test=None)
    test = evaluate(run.model, loader, run.world, run.plan.class_names, bf16=run.bf16, stop=run.stop.agreed)
    if test is None:
        raise run.stop.preempted(f"after epoch {run.cfg.epochs - 1} (before the final test)")
    return _write_metrics(run, test_accuracy=test.top1, test=test.to_json())


def main(argv: list[str] | None = None) -> int:
    """Parse, check, train; print the summary on rank 0. Returns 0; 2 after one
    ``python -m loaders.train: error: ...`` line on stderr (on every rank) for an error the
    platform raises on purpose: a bad option, environment, dataset, checkpoint, model or
    output; or 75 (:data:`~loaders.train.preemption.EXIT_PREEMPTED`) on every rank when SIGTERM or
    SIGUSR1 stopped the run after rank 0 saved a checkpoint (logged on rank 0)."""
    try:
        ranks = Ranks.from_env()
        line = f"%(asctime)s rank{ranks.rank} %(levelname)s %(name)s: %(message)s"
        logging.basicConfig(level=logging.INFO, format=line)
        cfg = parse_args(argv)
        plan = prepare(cfg, ranks.world_size)
        world = _init_distributed(cfg, ranks)
        try:
            metrics = train(cfg, world, plan)
        finally:
            if world.active and dist.is_initialized():
                dist.destroy_process_group()
    except Preempted:
        return EXIT_PREEMPTED
    except PlatformError as exc:
        rank = os.environ.get("RANK")
        # One write, newline included: ranks share torchrun's stderr, and unbuffered (print
        # writes the text and the newline apart) their lines would interleave.
        sys.stderr.write(f"{_PROG}: error: {exc}" + (f" (rank {rank})" if rank is not None else "") + "\n")
        sys.stderr.flush()
        return 2
    if world.rank == 0:
        print(_summary(cfg, metrics))
    return 0


def _summary(cfg: TrainConfig, metrics: dict[str, Any]) -> str:
    epochs = metrics["epochs"]
    last = epochs[-1] if epochs else {}
    shares = last.get("data_wait_share", [])
    test = metrics["test_accuracy"]
    return (
        f"test accuracy {'n/a (no test channel)' if test is None else f'{test:.4f}'} | "
        f"{last.get('images_per_s', float('nan')):.0f} images/s | "
        f"data wait {' '.join(f'{s:.0%}' for s in shares) or 'n/a'} (per rank) | "
        f"metrics: {storage.join(storage.normalize(cfg.output), 'metrics.json')}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
