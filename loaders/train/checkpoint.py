"""The checkpoint: rank 0 saves it (every rank learns whether it worked), and a run resumes
from the one :func:`~loaders.train.checks.prepare` found (:func:`resume`)."""

from __future__ import annotations

import io
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lakeshard import storage
from lakeshard.errors import PlatformError, StorageError
from loaders._internal.state import last_leg
from loaders.mixed_loader import MixedLoader
from loaders.shard_loader import ShardLoader
from loaders.train.checks import TrainPlan
from loaders.train.config import TrainConfig
from loaders.train.metrics import EpochTotals
from loaders.train.session import Run
from loaders.train.world import World, any_rank, info_level

__all__ = ["Start", "resume", "save_checkpoint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Start:
    """Where a run starts: the epoch, its totals a mid-epoch checkpoint saved (none for an
    epoch's start), and ``metrics.json``'s epochs before it."""

    epoch: int
    carried: EpochTotals
    history: list[dict[str, Any]]


def resume(
    cfg: TrainConfig,
    world: World,
    plan: TrainPlan,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.StepLR,
    loader: ShardLoader | MixedLoader,
) -> Start:
    """The optimiser's, the scheduler's and the training loader's state as the checkpoint saved
    them, and where the run goes on; epoch 0 without a checkpoint."""
    ckpt = plan.checkpoint
    if ckpt is None:
        if cfg.resume == "auto":
            log.log(
                info_level(world),
                "--resume auto: no checkpoint at %s, starting a fresh run",
                plan.checkpoint_uri,
            )
        return Start(0, EpochTotals(), [])
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
    return Start(epoch, carried, list(ckpt["metrics"]))


def save_checkpoint(run: Run, *, epoch_done: bool, partial: dict[str, Any] | None = None) -> None:
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


def _write_checkpoint(run: Run, *, epoch_done: bool, partial: dict[str, Any] | None) -> None:
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
