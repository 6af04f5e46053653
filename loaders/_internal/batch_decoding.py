"""What turns a loader's batch tasks into batches: the decoder, the transform, the memory and,
with a preparation cluster, the recipe the cluster's workers follow. One :class:`BatchDecoding`
per loader (a mixture has one per source); :meth:`BatchDecoding.for_epoch` gives the function
the pipeline's decode threads call for each task of one epoch (or one pass of a source)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lakeshard.errors import ConfigError
from lakeshard.format import DatasetInfo
from loaders._internal.buffers import BufferPool
from loaders._internal.prep import PrepCluster, Recipe, resolve_reference, transform_reference
from loaders.batch import BatchTask, DecodeSpec, DecodeTarget, SkippedRow, decode_batch, encoded_batch
from loaders.decode import NO_DECODER, get_batch_decoder, get_decoder
from loaders.named_batch import Batch, Collate
from loaders.options import LoaderOptions
from loaders.stats import DecodeTally
from loaders.transforms import Transform, default_transform

__all__ = ["BatchDecoding", "check_decoding", "resolve_collate", "resolve_transform"]


def resolve_transform(opts: LoaderOptions) -> tuple[Transform | None, str | None]:
    """The transform the options name (``augment``/``crop``/``normalize`` stand for
    :func:`~loaders.transforms.default_transform` without one) and, with a preparation cluster,
    the reference its workers import it by (checked before connecting)."""
    given = resolve_reference(opts.transform) if isinstance(opts.transform, str) else opts.transform
    transform = given or default_transform(augment=opts.augment, crop=opts.crop, normalize=opts.normalize)
    reference = None
    if opts.prep is not None and given is not None:
        reference = opts.transform if isinstance(opts.transform, str) else transform_reference(given)
    return transform, reference


def resolve_collate(opts: LoaderOptions) -> Collate | None:
    """The ``collate`` the options name (a callable, or imported from ``pkg.module:name``)."""
    if isinstance(opts.collate, str):
        return resolve_reference(opts.collate, what="collate")
    return opts.collate


def check_decoding(opts: LoaderOptions, info: DatasetInfo, dataset: str) -> None:
    """The decoding options against the dataset ``info`` describes: ``crop`` within its images;
    ``collate`` (which makes a multi-label or boxes dataset's batch) not for a single-label one.

    Raises:
        ConfigError: naming the option and the dataset.
    """
    if opts.crop is not None and opts.crop > info.image.size:
        raise ConfigError(f"crop must be at most the image size {info.image.size}, got {opts.crop!r}")
    if opts.collate is not None and info.task is None:
        raise ConfigError(
            f"collate={opts.collate!r} makes the batches of a multi-label or boxes dataset; {dataset} is "
            "single-label (batches (images, labels)): pass transform= instead",
            option="collate",
        )


def _collated(batch: Any, collate: Collate) -> Any:
    """``collate`` on a :class:`~loaders.Batch` (a transform may have made something else: that
    goes as it is); ``None`` (stopped) stays ``None``."""
    return collate(batch.images, batch) if isinstance(batch, Batch) else batch


@dataclass(frozen=True, eq=False)
class BatchDecoding:
    """How one loader (or one source of a mixture) decodes: the same in every epoch.

    ``rank`` is the rank the transform's draws are seeded with (a mixture's sources: 0);
    ``task``: the dataset's task kind (``None``: single-label), whose batches go through
    ``collate`` (``None``: yielded as :class:`~loaders.Batch`) on this node, after a preparation
    cluster made them."""

    options: LoaderOptions
    image_size: int
    num_classes: int
    shard_uris: tuple[str, ...]
    rank: int
    transform: Transform | None
    transform_ref: str | None
    buffers: BufferPool
    tally: DecodeTally
    prep: PrepCluster | None = None
    task: str | None = None
    collate: Collate | None = None

    @property
    def pin(self) -> bool:
        return self.options.pin_memory and torch.cuda.is_available()

    def for_epoch(self, epoch: int, skipped: list[SkippedRow]) -> Callable[[BatchTask, threading.Event], Any]:
        """What decodes a batch task of ``epoch`` (bad rows it skips go to ``skipped``)."""
        decode = self._decoder_of(epoch, skipped)
        collate = self.collate
        if collate is None:
            return decode
        return lambda task, stop: _collated(decode(task, stop), collate)

    def _decoder_of(
        self, epoch: int, skipped: list[SkippedRow]
    ) -> Callable[[BatchTask, threading.Event], Any]:
        opts = self.options
        encoded = opts.decoder == NO_DECODER
        target = DecodeTarget(
            size=self.image_size,
            num_classes=self.num_classes,
            task=self.task,
            shard_uris=self.shard_uris,
            seed=opts.seed,
            epoch=epoch,
            rank=self.rank,
            skip_bad_rows=opts.skip_bad_rows,
        ).target()
        spec = DecodeSpec(
            **target,
            decoder=None if encoded else get_decoder(opts.decoder),
            transform=self.transform,
            pin_memory=self.pin,
            buffers=self.buffers,
            skipped=skipped,
            batch_decoder=None if encoded else get_batch_decoder(opts.decoder),
            tally=self.tally,
        )
        if encoded:
            return lambda task, stop: encoded_batch(task, stop, spec)
        prep = self.prep
        if prep is not None:
            recipe = Recipe(
                **target,
                decoder=opts.decoder,
                transform=self.transform_ref,
                augment=opts.augment,
                crop=opts.crop,
                normalize=opts.normalize,
            )
            return lambda task, stop: prep.decode(task, stop, spec, recipe)
        return lambda task, stop: decode_batch(task, stop, spec)
