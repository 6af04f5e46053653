"""What the trainer counts and records per epoch: the totals of its training steps
(:class:`EpochTotals`, also saved mid-epoch in a checkpoint) and the epoch's line of
``metrics.json`` (:class:`EpochRecord`; the file's keys are in ``docs/training.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loaders.train.average_precision import AveragePrecision
from loaders.train.evaluation import Accuracy
from loaders.train.world import World, all_reduce

__all__ = ["STRAGGLER_MIN_WAIT", "EpochRecord", "EpochTotals", "LoaderSummary", "find_straggler"]

#: A rank is named a straggler when it waited at least this share of its step time for data...
STRAGGLER_MIN_WAIT = 0.10
#: ...and at least this many times the share of the rank that waited most after it (plus 5 points).
_STRAGGLER_RATIO = 2.0


def find_straggler(wait_shares: list[float], read_ms: list[float]) -> tuple[int, str] | None:
    """The rank that held the others back, and a line saying so, or ``None``: the rank whose
    share of step time spent waiting for data is at least :data:`STRAGGLER_MIN_WAIT` and more
    than twice (and 5 points above) every other rank's. ``read_ms``: each rank's mean store read
    time (0 for a rank that read nothing from the store)."""
    if len(wait_shares) < 2:
        return None
    rank = max(range(len(wait_shares)), key=wait_shares.__getitem__)
    worst = wait_shares[rank]
    others = [w for i, w in enumerate(wait_shares) if i != rank]
    if worst < STRAGGLER_MIN_WAIT or worst < _STRAGGLER_RATIO * max(others) + 0.05:
        return None
    line = f"rank {rank} waited {worst:.0%} for data, the others {min(others):.0%}-{max(others):.0%}"
    if read_ms[rank] > 0:
        rest = [m for i, m in enumerate(read_ms) if i != rank and m > 0]
        line += f"; its reads averaged {read_ms[rank]:.0f} ms"
        if rest:
            line += f" (the others {min(rest):.0f}-{max(rest):.0f} ms)"
    return rank, line


@dataclass(frozen=True, slots=True)
class LoaderSummary:
    """An epoch of the training loader over every rank: each rank's
    :meth:`loaders.stats.LoaderStats.to_json`, and the rank that held the others back."""

    per_rank: list[dict[str, Any]]
    straggler: int | None = None
    straggler_line: str | None = None

    def total(self, key: str) -> float:
        return sum(r[key] for r in self.per_rank)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": int(self.total("requests")),
            "retries": int(self.total("retries")),
            "bytes_read": int(self.total("bytes_read")),
            "cache_bytes": int(self.total("cache_bytes")),
            "cost_usd": self.total("cost_usd"),
            "straggler": self.straggler,
            "straggler_line": self.straggler_line,
            "shuffle": self.per_rank[0].get("shuffle"),
            "per_rank": self.per_rank,
        }


@dataclass(frozen=True, slots=True)
class EpochTotals:
    """An epoch's training totals: the loss summed over its real rows, those rows (``samples``)
    and every image trained on (pad rows included)."""

    loss_sum: float = 0.0
    samples: int = 0
    images: int = 0

    def __add__(self, other: EpochTotals) -> EpochTotals:
        return EpochTotals(
            self.loss_sum + other.loss_sum, self.samples + other.samples, self.images + other.images
        )

    @property
    def loss(self) -> float | None:
        """The mean loss over the real rows; None without any."""
        return self.loss_sum / self.samples if self.samples else None

    def all_reduce(self, world: World) -> EpochTotals:
        """These totals summed over every rank (one all-reduce: every rank calls it)."""
        loss_sum, samples, images = all_reduce([self.loss_sum, self.samples, self.images], world)
        return EpochTotals(loss_sum, int(samples), int(images))

    def to_checkpoint(self, epoch: int) -> dict[str, Any]:
        """A checkpoint's ``epoch_partial``: epoch ``epoch``'s totals so far."""
        return {"epoch": epoch, "loss_sum": self.loss_sum, "samples": self.samples, "images": self.images}

    @classmethod
    def from_checkpoint(cls, partial: dict[str, Any]) -> EpochTotals:
        """The totals a checkpoint's ``epoch_partial`` saved."""
        return cls(partial["loss_sum"], partial["samples"], partial["images"])


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """One epoch's line of ``metrics.json`` (``epochs``)."""

    epoch: int
    loss: float | None  # over the epoch's real rows, all ranks, before and after a resume
    validation: Accuracy | AveragePrecision | None  # None without a validation channel
    images_per_s: float  # this run's images of the epoch, all ranks, over the slowest rank's seconds
    data_wait_share: list[float]  # by rank: the share of step time spent waiting for data
    steps: int  # trained by this run (after a resume: the rest of the epoch)
    resumed_at_step: int
    samples: int  # the epoch's real rows, before and after a resume
    images: int
    legs: list[dict[str, int]]  # the world sizes the epoch ran at, as the loader state saves them
    lr: float  # after the epoch's scheduler step
    seconds: float  # the slowest rank's
    skipped_rows: int  # bad rows skipped by this rank's loader (``--skip-bad-rows``)
    sources: list[dict[str, Any]] | None = None  # a mixture's: weight, planned rows, rows taken
    loader: LoaderSummary | None = None  # the training loader's statistics, all ranks

    @property
    def val_accuracy(self) -> float | None:
        return self.validation.top1 if isinstance(self.validation, Accuracy) else None

    def to_json(self) -> dict[str, Any]:
        """The record as ``metrics.json`` (and a checkpoint's ``metrics``) has it."""
        return {
            "epoch": self.epoch,
            "loss": self.loss,
            "val_accuracy": self.val_accuracy,
            "validation": None if self.validation is None else self.validation.to_json(),
            "images_per_s": self.images_per_s,
            "data_wait_share": self.data_wait_share,
            "steps": self.steps,
            "resumed_at_step": self.resumed_at_step,
            "samples": self.samples,
            "images": self.images,
            "legs": self.legs,
            "lr": self.lr,
            "seconds": self.seconds,
            "skipped_rows": self.skipped_rows,
            **({} if self.sources is None else {"sources": self.sources}),
            "loader": None if self.loader is None else self.loader.to_json(),
        }
