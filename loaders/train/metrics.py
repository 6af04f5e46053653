"""What the trainer counts and records per epoch: the totals of its training steps
(:class:`EpochTotals`, also saved mid-epoch in a checkpoint) and the epoch's line of
``metrics.json`` (:class:`EpochRecord`; the file's keys are in ``docs/loader.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loaders.train.evaluation import Accuracy
from loaders.train.world import World, all_reduce

__all__ = ["EpochRecord", "EpochTotals"]


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
    validation: Accuracy | None  # None without a validation channel
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

    @property
    def val_accuracy(self) -> float | None:
        return None if self.validation is None else self.validation.top1

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
        }
