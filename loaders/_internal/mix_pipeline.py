"""A mixture's sources read by one pipeline: one reader thread, one pool of decode threads.

A :class:`~loaders.MixedLoader` batch is rows of several sources, each source read as its stream
(:mod:`loaders._internal.mixing`): passes of the source's rows at world size 1, one after another. Each
source is cut into *source batches* (batch ``k`` of pass ``p``: the rows a world-size-1 loader of
that source yields as its ``k``-th batch of epoch ``p``), decoded and transformed as such a
loader would, so that every row's pixels and augmentation draws depend only on the source, the
pass and the batch, never on the mixture around it.

Both sides walk the same :func:`needs` of an iteration (pure, from the plan): for each mixture
batch, the rows it takes of each source as ``(source, pass, batch, lo, hi)``. The reader thread
(:func:`source_batches`) turns the needs into the source batches in the order they are first
needed, reading each source through its own :class:`~loaders._internal.window_reader.WindowReader` (a
source's next batch of the same pass continues its reader; any other starts it there); the
decode threads decode them in that order; the consumer (:class:`Assembler`) takes each source
batch from the pipeline when its first row is needed, keeps it while rows of it are still to
come, and copies the rows of one mixture batch together.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from lakeshard.errors import LoaderError
from loaders._internal.batch_decoding import BatchDecoding
from loaders._internal.buffers import BufferPool
from loaders._internal.mixing import RankShare, Span, locate
from loaders._internal.run import Keyed
from loaders._internal.source import ShardSource
from loaders._internal.window_reader import WindowReader
from loaders.batch import PAD_LABEL, BatchTask, SkippedRow
from loaders.named_batch import Batch, joined
from loaders.stats import ReadCount

__all__ = [
    "Assembler",
    "MixSource",
    "Need",
    "mixture_batches",
    "needs",
    "relabelled",
    "shard_offsets",
    "source_batches",
]


@dataclass(frozen=True, eq=False)
class MixSource:
    """One source of a mixture as its pipeline reads it: the source, its reader at world size 1,
    how its batches are decoded, and the map of its labels into the mixture's (``None``: the same)."""

    source: ShardSource
    reader: WindowReader
    decoding: BatchDecoding
    lut: torch.Tensor | None

    @property
    def rows(self) -> int:
        return self.source.total_rows


class Need(NamedTuple):
    """Rows ``[lo, hi)`` of batch ``batch`` of pass ``pas`` of source ``source``."""

    source: int
    pas: int
    batch: int
    lo: int
    hi: int


class _Cursor:
    """A rank's runs of one source's stream in one leg, and how many of their rows it has taken."""

    def __init__(self, spans: tuple[Span, ...], taken: int) -> None:
        self.spans, self.taken = spans, taken

    def next_runs(self, n: int) -> list[Span]:
        """The stream positions of the next ``n`` rows (and takes them)."""
        out, skip, got = [], self.taken, 0
        for a, b in self.spans:
            if skip >= b - a:
                skip -= b - a
                continue
            lo = a + skip
            hi = min(b, lo + n - got)
            out.append((lo, hi))
            got, skip = got + hi - lo, 0
            if got == n:
                break
        if got != n:
            raise LoaderError(f"mixture plan: {n} rows asked of a source with {got} left in this leg")
        self.taken += n
        return out


def needs(
    share: RankShare, *, first: int, last: int, batch_size: int, taken: Sequence[int], rows: Sequence[int]
) -> Iterator[list[Need]]:
    """For each batch ``j`` in ``[first, last)`` of a rank's leg (``share``), the rows it takes of
    each source, source after source, cut at the sources' pass and batch boundaries; ``taken``:
    each source's rows the leg's batches before ``first`` took."""
    cursors = [_Cursor(spans, n) for spans, n in zip(share.spans, taken, strict=True)]
    b = batch_size
    for j in range(first, last):
        counts = np.bincount(share.order[j * b : (j + 1) * b], minlength=len(cursors))
        out: list[Need] = []
        for s, n in enumerate(counts.tolist()):
            if n:
                for lo, hi in cursors[s].next_runs(n):
                    out += _cut(s, lo, hi, rows[s], b)
        yield out


def _cut(source: int, lo: int, hi: int, rows: int, batch_size: int) -> list[Need]:
    """Stream positions ``[lo, hi)`` of a source as rows of its source batches."""
    out = []
    while lo < hi:
        pas, offset = locate(lo, rows)
        batch, at = divmod(offset, batch_size)
        n = min(hi - lo, batch_size - at, rows - offset)
        out.append(Need(source, pas, batch, at, at + n))
        lo += n
    return out


# NOTE [ One walk, two sides ]
#
# The reader thread (``source_batches`` or ``mixture_batches``, run by the pipeline as an epoch's
# task iterator) and the consumer (``MixedLoader._run``: ``Assembler.batch``, or the decoded
# mixture batches as they come) each make their own ``needs(...)`` of the same plan, so they walk
# the same list without sharing a cursor. The reader turns it into tasks in walk order; the
# pipeline hands them back decoded in the same order; the consumer takes the next one exactly
# when its walk first needs it, and checks the key it carries (a source batch) so that the two
# walks can never drift apart silently. Stopping: the pipeline's ``stop`` event ends the reader's
# walk (its source readers see it in their waits; ``_SourceTasks.close`` closes each reader's
# generator, which closes its shard files); an epoch closed by the consumer (its end, a ``break``,
# an error) sets it (NOTE [ Prefetch shutdown ] in pipeline.py).
class _SourceTasks:
    """The reader thread's side of each source: the batch tasks of its batches, its reader
    continued while it reads the next batch of the same pass and started anew elsewhere."""

    def __init__(
        self, sources: Sequence[MixSource], stop: threading.Event, reads: Sequence[ReadCount]
    ) -> None:
        self._sources, self._stop, self._reads = sources, stop, reads
        self._following: list[tuple[int, int] | None] = [None] * len(sources)
        self._open: list[Iterator[BatchTask] | None] = [None] * len(sources)

    def get(self, s: int, pas: int, batch: int) -> BatchTask | None:
        """The task of batch ``batch`` of pass ``pas`` of source ``s`` (``None``: stopped)."""
        if self._following[s] != (pas, batch):  # not the next batch of the pass being read: start there
            _close(self._open[s])
            self._open[s] = self._sources[s].reader.tasks(pas, batch, self._stop, reads=self._reads[s])
        tasks = self._open[s]
        task = next(tasks, None) if tasks is not None else None
        self._following[s] = (pas, batch + 1)
        return task

    def close(self) -> None:
        for tasks in self._open:
            _close(tasks)


def source_batches(
    sources: Sequence[MixSource],
    wanted: Iterator[list[Need]],
    stop: threading.Event,
    *,
    reads: Sequence[ReadCount],
    skipped: list[SkippedRow],
) -> Iterator[Keyed]:
    """The source batches ``wanted`` needs, in the order of their first need (runs on the
    reader thread). A source batch needed again right after itself is not read again."""
    held: list[tuple[int, int] | None] = [None] * len(sources)
    tasks = _SourceTasks(sources, stop, reads)
    decoders: dict[tuple[int, int], Callable[[BatchTask, threading.Event], Any]] = {}
    try:
        for batch_needs in wanted:
            for need in batch_needs:
                s, at = need.source, (need.pas, need.batch)
                if held[s] == at:
                    continue
                held[s] = at
                task = tasks.get(s, *at)
                if task is None:
                    return  # stopped
                if (s, need.pas) not in decoders:
                    decoders[s, need.pas] = sources[s].decoding.for_epoch(need.pas, skipped)
                yield Keyed((s, *at), task, decoders[s, need.pas])
    finally:
        tasks.close()


def mixture_batches(
    sources: Sequence[MixSource],
    wanted: Iterator[list[Need]],
    stop: threading.Event,
    *,
    reads: Sequence[ReadCount],
    epoch: int,
    first_index: int,
    decode: Callable[[BatchTask, threading.Event], Any],
) -> Iterator[Keyed]:
    """Each mixture batch ``wanted`` needs (batch ``first_index`` of ``epoch`` on) as one batch
    task of its rows, in the batch's order, keyed ``(-1, epoch, index)`` (runs on the reader
    thread): for sources whose rows decode alone (no transform, one label space), so that each
    row is decoded once, straight into its batch. A task's shard indices count the sources'
    shards one source after another (see :func:`shard_offsets`)."""
    held: list[tuple[tuple[int, int], BatchTask] | None] = [None] * len(sources)
    tasks = _SourceTasks(sources, stop, reads)
    offsets = shard_offsets(sources)
    index = first_index
    try:
        for batch_needs in wanted:
            parts = []
            for need in batch_needs:
                s, at = need.source, (need.pas, need.batch)
                kept = held[s]
                if kept is None or kept[0] != at:
                    task = tasks.get(s, *at)
                    if task is None:
                        return  # stopped
                    kept = held[s] = (at, task)
                parts.append((kept[1], need.lo, need.hi, offsets[s]))
            task = BatchTask(
                index,
                [image for t, lo, hi, _ in parts for image in t.images[lo:hi]],
                np.concatenate([t.labels[lo:hi] for t, lo, hi, _ in parts]),
                np.concatenate([t.pads[lo:hi] for t, lo, hi, _ in parts]),
                np.concatenate([t.shards[lo:hi] + at for t, lo, hi, at in parts]),
                np.concatenate([t.rows[lo:hi] for t, lo, hi, _ in parts]),
                _fields([(t.fields, lo, hi) for t, lo, hi, _ in parts]),
            )
            yield Keyed((-1, epoch, index), task, decode)
            index += 1
    finally:
        tasks.close()


def _fields(parts: list[tuple[pa.Table | None, int, int]]) -> pa.Table | None:
    """The label columns of rows ``[lo, hi)`` of each part's table, one after another, in the
    first part's column order (``None``: single-label rows)."""
    if parts[0][0] is None:
        return None
    names = parts[0][0].column_names
    return pa.concat_tables([t.select(names).slice(lo, hi - lo) for t, lo, hi in parts if t is not None])


def shard_offsets(sources: Sequence[MixSource]) -> list[int]:
    """Where each source's shards start in the sources' shards one after another."""
    return np.cumsum([0, *(len(m.source.shard_uris) for m in sources[:-1])]).tolist()


def _close(tasks: Iterator[BatchTask] | None) -> None:
    close = getattr(tasks, "close", None)
    if close is not None:
        close()  # a generator: run its finally blocks (closes the shard files)


#: A source batch as the assembler holds it: ``(images, labels)``, or a multi-label or boxes
#: dataset's :class:`~loaders.Batch`, in the mixture's label space.
_Held = tuple[torch.Tensor, torch.Tensor] | Batch


class Assembler:
    """The consumer's side: the mixture's batches, out of the decoded source batches.

    Keeps each source's batch in hand while rows of it are still to come; copies the rows of one
    mixture batch into a reused block (:meth:`join`). A multi-label or boxes source's batches
    are :class:`~loaders.Batch` es, mapped into the mixture's ``num_classes`` classes (their
    ``shards`` counted over the sources' shards one after another, :func:`shard_offsets`)."""

    def __init__(self, sources: Sequence[MixSource], buffers: BufferPool, *, num_classes: int) -> None:
        self._sources = sources
        self._buffers = buffers
        self._num_classes = num_classes
        self._offsets = shard_offsets(sources)
        self._held: list[tuple[tuple[int, int], _Held] | None] = [None] * len(sources)

    def batch(
        self, batch_needs: list[Need], next_decoded: Callable[[], tuple[tuple[int, int, int], Any]]
    ) -> tuple[_Held, list[int]]:
        """The mixture batch ``batch_needs`` describe, and the rows it took of each source."""
        parts: list[_Held] = []
        taken = [0] * len(self._sources)
        for need in batch_needs:
            s, at = need.source, (need.pas, need.batch)
            held = self._held[s]
            if held is None or held[0] != at:
                key, batch = next_decoded()
                if key != (s, *at):  # the reader's order and this one are the same walk of the plan
                    raise LoaderError(
                        f"mixture pipeline out of step: expected source batch {(s, *at)}, got {key}"
                    )
                held = self._held[s] = (at, self._checked(s, at, batch))
            got = held[1]
            if isinstance(got, Batch):
                parts.append(got.rows_of(need.lo, need.hi))
            else:
                parts.append((got[0][need.lo : need.hi], got[1][need.lo : need.hi]))
            taken[s] += need.hi - need.lo
        if isinstance(parts[0], Batch):
            named = [p for p in parts if isinstance(p, Batch)]
            return joined(named, self.join_images([p.images for p in named])), taken
        pairs = [p for p in parts if not isinstance(p, Batch)]
        return self.join(pairs), taken

    def _checked(self, s: int, at: tuple[int, int], batch: Any) -> _Held:
        """A source batch in the mixture's label space, of its own rows."""
        mix = self._sources[s]
        named = mix.source.info.task is not None
        if named and not isinstance(batch, Batch):
            raise LoaderError(
                f"a mixture needs a loaders.Batch from each source of a {mix.source.info.task} dataset; "
                f"{mix.source.dataset} gave {type(batch).__name__} (a transform must return (images, batch))"
            )
        if not named and not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise LoaderError(
                f"a mixture needs (images, labels) batches from each source; {mix.source.dataset} gave "
                f"{type(batch).__name__} (a transform must return (images, labels))"
            )
        images, labels = (batch.images, batch.valid) if isinstance(batch, Batch) else batch
        k = at[1]
        b = mix.reader.options.batch_size
        expected = min(b, mix.rows - k * b)
        if len(labels) != expected or len(images) != expected:
            raise LoaderError(
                f"a mixture needs a transform that keeps each batch's rows: batch {k} of {mix.source.dataset} "
                f"has {expected} rows and the transform returned {len(images)} images and {len(labels)} "
                "labels (a mixture takes each source's rows by position; make more views or drop rows in "
                "the training step instead)"
            )
        if isinstance(batch, Batch):
            return batch.in_classes(mix.lut, self._num_classes, shard_offset=self._offsets[s])
        return images, relabelled(labels, mix.lut)

    def join(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of the sources' rows, source after source (:meth:`join_images`)."""
        if len(parts) == 1:
            return parts[0]
        return self.join_images([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def join_images(self, images: list[Any]) -> Any:
        """The parts' images as one batch: one copy of each part's pixels into a reused block (a
        block of pinned memory when the parts are pinned), single-threaded (``torch.cat``
        spreads a copy over torch's intra-op threads, which then wait on the cores the decode
        threads use: half the mixture's throughput on 2 cores)."""
        if len(images) == 1:
            return images[0]
        nhwc = [x.permute(0, 2, 3, 1) for x in images]
        if images[0].dtype != torch.uint8 or not all(x.is_contiguous() for x in nhwc):
            return torch.cat(images)
        shape = (sum(len(x) for x in images), *nhwc[0].shape[1:])
        if images[0].is_pinned():
            out = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            block = out.numpy()
        else:
            block = self._buffers.take(shape)
            out = torch.from_numpy(block)
        np.concatenate([x.numpy() for x in nhwc], out=block)
        return out.permute(0, 3, 1, 2)


def relabelled(labels: torch.Tensor, lut: torch.Tensor | None) -> torch.Tensor:
    """``labels`` mapped by ``lut`` (pad rows kept); ``labels`` itself where ``lut`` is ``None``."""
    if lut is None:
        return labels
    return torch.where(labels != PAD_LABEL, lut[labels.clamp(min=0)], labels)
