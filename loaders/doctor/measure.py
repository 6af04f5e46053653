"""The data stages, each measured alone: the store's read rate (a ``decoder="none"`` loader),
decoding on 1, 2, 4, ... threads, and the transform on one thread (on what the loader gives it:
``(images, labels)``, or a multi-label or boxes dataset's images and :class:`~loaders.Batch`).

Every stage runs for a time, not for a number of images, so a slow stage costs no more than a
fast one; each keeps going until its time is up (a short epoch is followed by the next one).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lakeshard.errors import LoaderError
from loaders.decode import get_batch_decoder, get_decoder
from loaders.doctor.figures import DecodeFigures, DecodeRun, StoreFigures, TransformFigures
from loaders.doctor.references import describe
from loaders.named_batch import Batch, batch_of_rows
from loaders.shard_loader import ShardLoader
from loaders.transforms import Transform, batch_generator

__all__ = [
    "SAMPLE",
    "Sample",
    "decode_threads",
    "measure_decode",
    "measure_store",
    "measure_transform",
    "timed_batches",
]

#: Encoded images kept from the store stage for the decode stage.
SAMPLE = 2000
#: Decoded batches kept from the decode stage for the transform stage.
_TRANSFORM_BATCHES = 4
#: The loader's decoder (``decoder="auto"``).
_DECODER = "auto"


@dataclass(frozen=True, slots=True)
class Sample:
    """Encoded images of the store stage, with their labels, in the order they came: a
    single-label dataset's ``labels``; a multi-label or boxes dataset's (``task``) rows' label
    columns ``fields``, its classes ``num_classes``."""

    images: list[bytes]
    labels: list[int]
    task: str | None = None
    num_classes: int = 0
    fields: list[pa.Table] = field(default_factory=list)


def timed_batches(loader: ShardLoader, seconds: float) -> Iterator[Any]:
    """``loader``'s batches, epoch after epoch, until ``seconds`` have passed since the first
    batch came (the batch that arrives after the deadline is the last): the rates, which count
    from the first batch on, get their whole window however long the loader takes to start (a
    busy machine's first batch once took longer than the window, and one batch is no rate).
    Leaving the epoch mid-way stops its threads."""
    deadline = None
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        batches = 0
        for batch in loader:
            if deadline is None:
                deadline = time.perf_counter() + seconds
            yield batch
            batches += 1
            if time.perf_counter() >= deadline:
                return
        if batches == 0:  # an empty channel: nothing to time
            return


def measure_store(dataset: str, options: dict[str, Any], *, seconds: float) -> tuple[StoreFigures, Sample]:
    """Stage 1: a fresh ``ShardLoader(decoder="none", **options)`` iterated for ``seconds``.

    Returns its figures and up to :data:`SAMPLE` of the encoded images it yielded."""
    began = time.perf_counter()
    loader = ShardLoader(dataset, decoder="none", **options)
    open_s = time.perf_counter() - began
    rows = nbytes = batches = first_rows = 0
    first = 0.0
    sample = Sample([], [], task=loader.info.task, num_classes=loader.info.num_classes)
    with loader:
        before = loader.totals()
        start = time.perf_counter()
        for batch in timed_batches(loader, seconds):
            if batches == 0:
                first, first_rows = time.perf_counter() - start, len(batch.images)
            batches += 1
            rows += len(batch.images)
            nbytes += sum(image.numel() for image in batch.images)
            _keep(sample, batch)
        elapsed = time.perf_counter() - start
        moved = loader.totals() - before
        epochs = loader.epoch + 1
    store = moved.store
    remote = loader.fetcher is not None
    figures = StoreFigures(
        rows=rows,
        batches=batches,
        seconds=elapsed,
        bytes=store.bytes + moved.cache_bytes if remote else nbytes,
        open_s=open_s,
        first_batch_s=first,
        first_rows=first_rows,
        epochs=epochs,
        requests=store.requests,
        reads=store.reads,
        read_s=store.seconds,
        cache_hits=moved.cache_hits,
        cache_misses=moved.cache_misses,
        cache_bytes=moved.cache_bytes,
    )
    return figures, sample


def _keep(sample: Sample, batch: Any) -> None:
    """The rows of an encoded ``batch`` (not empty) that :data:`SAMPLE` leaves room for, into
    ``sample``."""
    kept = [i for i, image in enumerate(batch.images) if image.numel()][: SAMPLE - len(sample.images)]
    sample.images.extend(batch.images[i].numpy().tobytes() for i in kept)
    if isinstance(batch, Batch):
        if kept and batch.table is not None:
            sample.fields.append(batch.table.take(kept))
    else:
        labels = batch.labels.tolist()
        sample.labels.extend(labels[i] for i in kept)


def decode_threads(threads: int) -> list[int]:
    """1, 2, 4, ... below ``threads``, then ``threads``."""
    out = [k for k in (2**i for i in range(threads.bit_length())) if k < threads]
    return [*out, threads]


def _decode_into(images: list[bytes], out: np.ndarray) -> None:
    """What the loader's decode thread does with a batch (``decoder="auto"``): the batch decoder
    (``loaders._jpeg``) first, the image-by-image decoder for the rows it leaves."""
    batch, each = get_batch_decoder(_DECODER), get_decoder(_DECODER)
    todo = batch(images, out) if batch is not None else range(len(images))
    for i in todo:
        try:
            each(images[i], out[i])
        except Exception as exc:
            raise LoaderError(
                f"cannot decode image {i} of a sampled batch: {type(exc).__name__}: {exc}"
            ) from exc


def _chunks(sample: Sample, batch_size: int) -> list[list[bytes]]:
    return [sample.images[i : i + batch_size] for i in range(0, len(sample.images), batch_size)]


def _timed_run(chunks: list[list[bytes]], size: int, threads: int, seconds: float) -> DecodeRun:
    """``threads`` threads decoding the chunks round and round for ``seconds``."""
    counter = itertools.count()  # next() of a count is atomic under the GIL
    rows = max(len(c) for c in chunks)
    start = time.perf_counter()
    deadline = start + seconds

    def work() -> tuple[int, float, float]:
        out = np.empty((rows, size, size, 3), dtype=np.uint8)
        cpu, images = time.thread_time(), 0
        while True:
            chunk = chunks[next(counter) % len(chunks)]
            _decode_into(chunk, out[: len(chunk)])
            images += len(chunk)
            if time.perf_counter() >= deadline:
                return images, time.thread_time() - cpu, time.perf_counter()

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="doctor-decode") as pool:
        done = [f.result() for f in [pool.submit(work) for _ in range(threads)]]  # re-raises a failure
    return DecodeRun(
        threads=threads,
        images=sum(d[0] for d in done),
        seconds=max(d[2] for d in done) - start,
        cpu_s=sum(d[1] for d in done),
    )


def measure_decode(
    sample: Sample, *, size: int, batch_size: int, threads: int, seconds: float
) -> tuple[DecodeFigures, list[tuple[torch.Tensor, Any]]]:
    """Stage 2: the sample decoded on k = 1, 2, 4, ... ``threads`` threads, ``seconds`` shared
    among them. Also returns a few decoded batches (the loader's layout: uint8
    ``[B, 3, H, W]``, channels_last, with their labels or :class:`~loaders.Batch`) for the
    transform stage."""
    chunks = _chunks(sample, batch_size)
    decoded = []
    for lo in range(0, min(len(sample.images), _TRANSFORM_BATCHES * batch_size), batch_size):
        part = sample.images[lo : lo + batch_size]
        out = np.empty((len(part), size, size, 3), dtype=np.uint8)
        _decode_into(part, out)  # also the warm-up
        images = torch.from_numpy(out).permute(0, 3, 1, 2)
        decoded.append((images, _labels(sample, images, lo)))
    ks = decode_threads(threads)
    runs = tuple(_timed_run(chunks, size, k, seconds / len(ks)) for k in ks)
    figures = DecodeFigures(sample=len(sample.images), sample_bytes=sum(map(len, sample.images)), runs=runs)
    return figures, decoded


def _labels(sample: Sample, images: torch.Tensor, lo: int) -> Any:
    """What the loader hands the transform with ``images``, rows ``lo`` on of ``sample``: their
    labels, or a multi-label or boxes dataset's :class:`~loaders.Batch`."""
    n = len(images)
    if sample.task is None:
        return torch.tensor(sample.labels[lo : lo + n], dtype=torch.int64)
    table = pa.concat_tables(sample.fields).slice(lo, n)
    return batch_of_rows(
        images,
        table,
        valid=np.ones(n, dtype=bool),
        num_classes=sample.num_classes,
        task=sample.task,
        shards=np.zeros(n, dtype=np.int64),
        rows=np.arange(lo, lo + n, dtype=np.int64),
    )


def _copy(images: torch.Tensor, labels: Any) -> tuple[torch.Tensor, Any]:
    """A copy of a decoded batch (the transform may change its input in place, as the loader
    allows)."""
    x = images.clone()
    if isinstance(labels, Batch):
        boxes = None if labels.boxes is None else [b.clone() for b in labels.boxes]
        return x, labels.replace(images=x, labels=labels.labels.clone(), boxes=boxes)
    return x, labels.clone()


def measure_transform(
    transform: Transform, batches: list[tuple[torch.Tensor, Any]], *, seconds: float
) -> TransformFigures:
    """Stage 3: ``transform`` on copies of the decoded ``batches``, one call at a time on this
    thread, for ``seconds`` (one call at least). CPU time is counted around each call only.

    Torch's intra-op threads are set to one meanwhile, so that the work stays on this thread
    and is counted by ``time.thread_time``: a thread pool's share would escape it, and the
    process's CPU time would also count the pool's threads spinning between operations (2 to 4
    times the work, measured on a busy 2-core machine)."""
    images = calls = 0
    cpu = thread_cpu = wall = 0.0
    output = ""
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        deadline = time.perf_counter() + seconds
        while calls == 0 or time.perf_counter() < deadline:
            x, y = _copy(*batches[calls % len(batches)])
            generator = batch_generator(0, 0, 0, calls)
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            out = transform(x, y, generator)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            thread_cpu += time.thread_time() - h0
            if not output:
                output = describe(out)
            images += x.shape[0]
            calls += 1
    finally:
        torch.set_num_threads(intra_op)
    return TransformFigures(images=images, seconds=wall, cpu_s=cpu, thread_cpu_s=thread_cpu, output=output)
