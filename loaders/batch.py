"""One batch of work for a decode thread: encoded rows in, ``(images, labels)`` tensors out.

Images are uint8 ``[B, 3, H, W]`` in ``torch.channels_last`` memory format; labels are int64
``[B]``. Then the batch goes through ``DecodeSpec.transform`` (:mod:`loaders.transforms`), on
the same thread, and the batch is what the transform returns. A multi-label or boxes dataset's
rows carry their label columns (``BatchTask.fields``) and make a :class:`~loaders.Batch`
(:mod:`loaders.named_batch`), which the transform gets in place of the labels.

A decode thread gets a whole batch, so the cost of handing out a task is paid once per batch,
not once per image. The transform's generator is seeded by ``(seed, epoch, rank, batch index)``,
so augmentation does not depend on which thread decodes the batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from lakeshard.errors import LoaderError
from loaders._internal.buffers import BufferPool
from loaders.decode import BatchDecoder, Buffer
from loaders.named_batch import Batch, bad_label_rows, batch_of_rows
from loaders.stats import DecodeTally
from loaders.transforms import Transform, batch_generator

__all__ = [
    "NULL_LABEL",
    "PAD_LABEL",
    "BatchTask",
    "DecodeSpec",
    "DecodeTarget",
    "EncodedBatch",
    "SkippedRow",
    "decode_batch",
    "encoded_batch",
    "pinned",
]

log = logging.getLogger(__name__)

#: The label of a row that must not count: a row repeated to even out ranks, a row the dataset
#: marks ``is_pad``, or a bad row skipped with ``skip_bad_rows=True`` (its image is all zeros).
#: It is ``torch.nn.CrossEntropyLoss``'s default ``ignore_index``, so losses skip it unchanged.
PAD_LABEL = -100
#: What the reader puts for a null label: the row is bad ("label is null").
NULL_LABEL = np.iinfo(np.int64).min


@dataclass(frozen=True, slots=True)
class SkippedRow:
    shard_uri: str
    row: int
    reason: str


@dataclass(slots=True)
class BatchTask:
    """Rows of one batch, in batch order. ``images`` are the encoded images (``None`` for a
    null); ``shards`` index into ``DecodeSpec.shard_uris``; ``rows`` are row numbers within
    those shards."""

    index: int
    images: Sequence[Buffer | None]
    labels: np.ndarray
    pads: np.ndarray
    shards: np.ndarray
    rows: np.ndarray
    #: The rows' label columns (a multi-label or boxes dataset; ``None``: single-label).
    fields: pa.Table | None = None


class EncodedBatch(NamedTuple):
    """A batch of ``decoder="none"``: the rows a decoding loader would decode, in its order.

    ``images``: each row's encoded image as a 1-D uint8 tensor (what
    ``torchvision.io.decode_jpeg(images, device="cuda")`` takes); ``labels``: int64 ``[B]``,
    :data:`PAD_LABEL` where the decoded batch has it; ``shards`` and ``rows``: int64 ``[B]``, each
    row's shard (an index into :attr:`ShardLoader.shard_uris`) and row number in it."""

    images: list[torch.Tensor]
    labels: torch.Tensor
    shards: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True)
class DecodeTarget:
    """What a batch's rows are decoded for, wherever they are decoded (this process:
    :class:`DecodeSpec`; a preparation cluster's worker: :class:`loaders._internal.prep.Recipe`): the
    image size, the classes, the shards its rows name, the ``(seed, epoch, rank)`` its random
    draws are seeded with, whether a bad row is skipped, and the dataset's task kind (``None``:
    single-label; else its rows make a :class:`~loaders.Batch`)."""

    size: int
    num_classes: int
    task: str | None
    shard_uris: tuple[str, ...]
    seed: int
    epoch: int
    rank: int
    skip_bad_rows: bool

    def target(self) -> dict[str, Any]:
        """These fields by name (to make a :class:`DecodeSpec` or a ``Recipe`` of them)."""
        return {f.name: getattr(self, f.name) for f in fields(DecodeTarget)}


@dataclass(frozen=True)
class DecodeSpec(DecodeTarget):
    """How this process decodes a batch task: the target, and the decoders, the transform and
    where the rows go."""

    #: Decodes one image into its slot; ``None`` with ``decoder="none"`` (:func:`encoded_batch`).
    decoder: Callable[..., np.ndarray] | None
    #: Runs on each decoded batch: ``transform(images, labels, generator)``; ``None``: none.
    transform: Transform | None = None
    pin_memory: bool = False
    #: Where decoded images go (reused blocks); ``None``: a fresh array per batch.
    buffers: BufferPool | None = None
    #: Where skipped rows are reported (list.append is atomic; shared by all decode threads).
    skipped: list[SkippedRow] = field(default_factory=list)
    #: Goes first over the whole batch (one release of the GIL); ``decoder`` takes the rows it leaves.
    batch_decoder: BatchDecoder | None = None
    #: Counts the rows decoded and the decode threads' CPU seconds; ``None``: not counted.
    tally: DecodeTally | None = None


def _bad_row(spec: DecodeSpec, task: BatchTask, i: int, what: str, exc: BaseException | None) -> None:
    uri, row = spec.shard_uris[int(task.shards[i])], int(task.rows[i])
    if spec.skip_bad_rows:
        reason = f"{what}: {exc}" if exc is not None else what
        spec.skipped.append(SkippedRow(uri, row, reason))
        log.warning("skipping row %d of %s: %s", row, uri, reason)
        return
    detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    raise LoaderError(f"{what} at row {row} of {uri}{detail}") from exc


#: Rows of one shard an error message lists before it abbreviates.
_ROWS_SHOWN = 8


def _where(spec: DecodeSpec, task: BatchTask) -> str:
    """The rows of a batch, by shard: ``rows 3, 8, 9 of <uri>; rows 0, 1 of <uri>``."""
    by_shard: dict[int, list[int]] = {}
    for shard, row in zip(task.shards.tolist(), task.rows.tolist(), strict=True):
        by_shard.setdefault(shard, []).append(row)
    parts = []
    for shard, rows in by_shard.items():
        shown = ", ".join(map(str, rows[:_ROWS_SHOWN])) + (
            f", ... ({len(rows)} rows)" if len(rows) > _ROWS_SHOWN else ""
        )
        parts.append(f"rows {shown} of {spec.shard_uris[shard]}")
    return "; ".join(parts)


def _transform(
    transform: Transform, spec: DecodeSpec, task: BatchTask, images: torch.Tensor, labels: torch.Tensor
) -> Any:
    """``transform`` (``spec.transform``) on one batch; its failure becomes a :class:`LoaderError`
    naming the rows."""
    generator = batch_generator(spec.seed, spec.epoch, spec.rank, task.index)
    try:
        out = transform(images, labels, generator)
    except Exception as exc:
        raise LoaderError(
            f"transform {transform!r} failed on batch {task.index} ({_where(spec, task)}): {type(exc).__name__}: {exc}"
        ) from exc
    if out is None:
        raise LoaderError(
            f"transform {transform!r} returned None for batch {task.index} ({_where(spec, task)})"
        )
    return out


def pinned(batch: Any) -> Any:
    """``batch`` with its tensors (itself, the items of a tuple or list, a :class:`Batch`'s) in
    pinned memory."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, Batch):
        return batch.pinned()
    if isinstance(batch, tuple | list):
        return type(batch)(pinned(b) if isinstance(b, torch.Tensor) else b for b in batch)
    return batch


def _bad_labels(task: BatchTask, spec: DecodeSpec) -> tuple[np.ndarray, list[str | None] | None]:
    """The batch's labels as int64 (a copy) and, if any row's label is null or out of range
    (pads aside), why, row by row (``None`` for a good row). A multi-label or boxes row's
    labels are its label columns' (:func:`~loaders.named_batch.bad_label_rows`)."""
    labels = task.labels.astype(np.int64, copy=True)
    if task.fields is not None:
        reasons = bad_label_rows(task.fields, spec.num_classes)
        bad = [None if pad else r for r, pad in zip(reasons, task.pads.tolist(), strict=True)]
        return labels, bad if any(bad) else None
    bad_label = ~task.pads & ((labels < 0) | (labels >= spec.num_classes))
    if not bad_label.any():
        return labels, None
    return labels, [_label_error(labels, i, spec) if b else None for i, b in enumerate(bad_label.tolist())]


def _label_error(labels: np.ndarray, i: int, spec: DecodeSpec) -> str:
    if labels[i] == NULL_LABEL:
        return "label is null"
    return f"label {int(labels[i])} out of range [0, {spec.num_classes})"


def encoded_batch(task: BatchTask, stop: threading.Event, spec: DecodeSpec) -> EncodedBatch | Batch | None:
    """One batch of ``decoder="none"``: the encoded images as they are stored, and the labels,
    shards and rows; a bad label or a null image is what :func:`decode_batch` makes of it (a
    :class:`LoaderError`, or with ``skip_bad_rows`` an empty image labelled ``PAD_LABEL``).
    Whether an image decodes is the decoding side's to find out. A multi-label or boxes
    dataset's batch is a :class:`Batch` of the encoded images. ``None`` if ``stop`` was set."""
    if stop.is_set():
        return None
    labels, bad = _bad_labels(task, spec)
    images = []
    for i, data in enumerate(task.images):
        reason = bad[i] if bad is not None else None
        if reason is not None:
            _bad_row(spec, task, i, reason, None)
        elif data is None:
            _bad_row(spec, task, i, "image is null", None)
        else:
            images.append(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()))
            continue
        images.append(torch.empty(0, dtype=torch.uint8))
        labels[i] = PAD_LABEL
    labels[task.pads] = PAD_LABEL
    if task.fields is not None:
        return _named(images, labels != PAD_LABEL, task, spec)
    return EncodedBatch(
        images,
        torch.from_numpy(labels),
        torch.from_numpy(task.shards.astype(np.int64, copy=True)),
        torch.from_numpy(task.rows.astype(np.int64, copy=True)),
    )


def decode_batch(task: BatchTask, stop: threading.Event, spec: DecodeSpec) -> Any:
    """Decode and transform one batch (:func:`_decode`); ``None`` if ``stop`` was set meanwhile.
    Its rows and this thread's CPU seconds, decoding and transforming, go to ``spec.tally``."""
    began = time.thread_time()
    batch: Any = _decode(task, stop, spec)
    if batch is None:
        return None
    decoded = time.thread_time()
    if task.fields is not None:
        images, labels = batch
        batch = _named(images, labels.numpy() != PAD_LABEL, task, spec)
        if spec.transform is not None:
            batch = _with_images(_transform(spec.transform, spec, task, batch.images, batch))
    elif spec.transform is not None:
        batch = _transform(spec.transform, spec, task, *batch)
    if spec.tally is not None:
        spec.tally.add(len(task.images), decoded - began, time.thread_time() - decoded)
    return pinned(batch) if spec.pin_memory else batch


def _named(images: Any, valid: np.ndarray, task: BatchTask, spec: DecodeSpec) -> Batch:
    """The :class:`Batch` of a multi-label or boxes batch; ``valid``: the rows the decode did not
    label :data:`PAD_LABEL` (pads, skipped rows)."""
    assert task.fields is not None and spec.task is not None  # a task's rows carry their fields
    return batch_of_rows(
        images,
        task.fields,
        valid=valid,
        num_classes=spec.num_classes,
        task=spec.task,
        shards=task.shards,
        rows=task.rows,
    )


def _with_images(out: Any) -> Any:
    """What a transform returned for a :class:`Batch`: ``(images, batch)`` becomes the batch with
    those images; anything else is yielded as it is."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Batch):
        return out[1].replace(images=out[0])
    return out


def _decode(
    task: BatchTask, stop: threading.Event, spec: DecodeSpec
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode one batch into ``(images, labels)``; ``None`` if ``stop`` was set meanwhile.

    Each image is decoded straight into its slot of one ``[B, H, W, 3]`` array taken from
    ``spec.buffers`` (no per-image array, no stacking, no fresh pages). ``spec.batch_decoder``
    decodes the whole batch first, with one release of the GIL; the loop then visits only the
    rows it left and the rows with a bad label, in row order (the first bad row is the one
    reported). Without it, the loop decodes every row with ``spec.decoder``.
    """
    n, s = len(task.images), spec.size
    hwc = (
        spec.buffers.take((n, s, s, 3))
        if spec.buffers is not None
        else np.empty((n, s, s, 3), dtype=np.uint8)
    )
    labels, bad = _bad_labels(task, spec)
    decoder, is_set = spec.decoder, stop.is_set
    assert decoder is not None, "decoder='none' batches are encoded_batch's"
    todo: Iterable[int] = range(n)
    if spec.batch_decoder is not None:
        left = spec.batch_decoder(task.images, hwc)
        todo = sorted(set(left).union(i for i, b in enumerate(bad) if b)) if bad is not None else left
        if is_set():
            return None
    images = task.images
    for i in todo:
        if is_set():
            return None
        data = images[i]
        reason = bad[i] if bad is not None else None
        if reason is not None:
            _bad_row(spec, task, i, reason, None)
        elif data is None:
            _bad_row(spec, task, i, "image is null", None)
        else:
            try:
                decoder(data, hwc[i])
                continue
            except Exception as exc:
                _bad_row(spec, task, i, "cannot decode image", exc)
        hwc[i] = 0
        labels[i] = PAD_LABEL
    labels[task.pads] = PAD_LABEL

    # [B, 3, H, W] in channels_last memory format: a zero-copy view of the decoded NHWC buffer.
    # (A .contiguous() NCHW copy here halved the loader's throughput on 2 cores; convolutions
    # take channels_last as is, and callers who need NCHW can call .contiguous() themselves.)
    return torch.from_numpy(hwc).permute(0, 3, 1, 2), torch.from_numpy(labels)
