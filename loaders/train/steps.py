"""An epoch's training steps: the forward and backward pass of each batch, the time spent
waiting for data, a checkpoint every ``--checkpoint-every`` steps, a stop at an agreed step."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from loaders.batch import PAD_LABEL
from loaders.named_batch import Batch
from loaders.train.checkpoint import save_checkpoint
from loaders.train.metrics import EpochTotals
from loaders.train.session import Run
from loaders.train.world import all_gather, all_reduce, gather

__all__ = ["Trained", "train_epoch"]


class _BatchLoss(NamedTuple):
    """A batch's mean loss over its real rows, and how many there are."""

    mean: torch.Tensor
    rows: int


def _loss(logits: torch.Tensor, labels: torch.Tensor | Batch) -> _BatchLoss:
    """Mean cross-entropy over rows that count (padding is labelled PAD_LABEL); for a multi-label
    batch, binary cross-entropy of each class (``BCEWithLogitsLoss``) over its valid rows."""
    if isinstance(labels, Batch):
        return _multi_label_loss(logits, labels)
    valid = int((labels != PAD_LABEL).sum())
    if valid == 0:  # keep the graph (DDP needs every parameter's gradient), contribute nothing
        return _BatchLoss(logits.sum() * 0.0, 0)
    return _BatchLoss(F.cross_entropy(logits, labels, ignore_index=PAD_LABEL, reduction="sum") / valid, valid)


def _multi_label_loss(logits: torch.Tensor, batch: Batch) -> _BatchLoss:
    """Mean over the valid rows of the sum over classes of binary cross-entropy with logits."""
    valid = batch.valid.to(logits.device)
    rows = int(valid.sum())
    if rows == 0:  # as above: the graph kept, nothing contributed
        return _BatchLoss(logits.sum() * 0.0, 0)
    targets = batch.labels.to(logits.device, non_blocking=True)
    loss = F.binary_cross_entropy_with_logits(logits[valid].float(), targets[valid], reduction="sum")
    return _BatchLoss(loss / rows, rows)


def _inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor | Batch]:
    """A batch's images and what the loss compares the model's output with: its labels, or a
    multi-label dataset's :class:`~loaders.Batch`."""
    if isinstance(batch, Batch):
        return batch.images, batch
    images, labels = batch
    return images, labels


@dataclass(frozen=True, slots=True)
class _Step:
    """A training step's mean loss (what the progress bar shows) and its totals."""

    loss: float
    totals: EpochTotals


def _step(run: Run, images: torch.Tensor, labels: torch.Tensor | Batch) -> _Step:
    """One forward and backward pass and optimiser step on a batch."""
    images = images.to(run.world.device, non_blocking=True)
    if isinstance(labels, torch.Tensor):
        labels = labels.to(run.world.device, non_blocking=True)
    with run.world.autocast(run.bf16):
        loss = _loss(run.ddp(images), labels)
    run.optimizer.zero_grad(set_to_none=True)
    loss.mean.backward()
    run.optimizer.step()
    value = float(loss.mean.detach())
    return _Step(value, EpochTotals(value * loss.rows, loss.rows, len(images)))


@dataclass(frozen=True, slots=True)
class Trained:
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


def train_epoch(run: Run, epoch: int, carried: EpochTotals) -> Trained:
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
        for step, batch in enumerate(loader, start=first_step):
            got = time.perf_counter()
            wait += got - tick
            done = _step(run, *_inputs(batch))
            here += done.totals
            tick = time.perf_counter()
            compute += tick - got
            bar.update(1)
            bar.set_postfix(loss=f"{done.loss:.3f}")
            stopped = run.stop.agreed()
            if stopped or (every and (step + 1) % every == 0 and step + 1 < steps):
                so_far = here.all_reduce(world) + carried
                save_checkpoint(run, epoch_done=False, partial=so_far.to_checkpoint(epoch))
            if stopped:
                raise run.stop.preempted(f"at epoch {epoch}, step {step + 1} of {steps}")
    elapsed = time.perf_counter() - epoch_start
    everyone = here.all_reduce(world)
    (slowest,) = all_reduce([elapsed], world, maximum=True)
    shares = all_gather(wait / (wait + compute) if wait + compute > 0 else 0.0, world)
    stats = gather(loader.epoch_stats().to_json(), world)
    return Trained(everyone + carried, everyone.images, slowest, shares, first_step, steps, stats)
