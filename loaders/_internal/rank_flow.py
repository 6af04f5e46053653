"""A single dataset's rank: its reader (:func:`rank_reader`) and how it runs its flow (NOTE [ A
loader's flow ] in :mod:`loaders._internal.run`): where a flow starts, what it reads ahead, and its
tasks, epoch after epoch, on the reader thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from lakeshard.errors import ConfigError
from loaders._internal.batch_decoding import BatchDecoding
from loaders._internal.epoch_reads import EpochPlan
from loaders._internal.plan import num_batches, rank_segments, rows_per_rank, split_pieces
from loaders._internal.run import EpochParts, Flow, Iterations, Keyed
from loaders._internal.shuffle_quality import tallied
from loaders._internal.source import ShardSource
from loaders._internal.window_reader import WindowReader
from loaders.options import LoaderOptions

__all__ = ["SETTLE_S", "rank_reader", "start_flow"]

#: How long an epoch's start waits for the cache to finish the file the last epoch filled (its
#: sha256 over the shard) before it reads the shard from the store instead.
SETTLE_S = 5.0


def rank_reader(source: ShardSource, options: LoaderOptions, name: str) -> WindowReader:
    """The reader of rank ``options.rank``'s pieces of ``source``'s shards
    (:mod:`loaders._internal.plan`). Reads their footers, once per loader: a remote shard's is
    kept (with its size and ETag) for the ranged reads of every epoch.

    Raises:
        ConfigError: ``drop_last`` leaves no batch.
    """
    opts = options
    per_rank = rows_per_rank(source.total_rows, opts.world_size, remainder=opts.remainder)
    batches = num_batches(per_rank, opts.batch_size, drop_last=opts.drop_last)
    if batches == 0:
        raise ConfigError(
            f"batch_size {opts.batch_size} with drop_last=True leaves no batch: each of {opts.world_size} "
            f"ranks reads {per_rank} rows of channel {opts.channel!r} of {source.dataset}"
        )
    segments = rank_segments(source.shard_rows, opts.world_size, opts.rank, remainder=opts.remainder)
    groups = source.read_footers(
        sorted({seg.shard for seg in segments}), concurrency=opts.read_plan.footer_threads, name=name
    )
    return WindowReader(
        source, opts, pieces=split_pieces(segments, groups), num_batches=batches, rows_per_rank=per_rank
    )


def start_flow(
    runs: Iterations,
    reader: WindowReader,
    decoding: BatchDecoding,
    *,
    epoch: int,
    start: int,
    plan: EpochPlan | None,
    looping: bool,
    first_iteration: bool,
) -> Flow:
    """Start a flow from batch ``start`` of ``epoch`` (read as ``plan`` says: a resumed epoch's;
    default: its own). Its first epoch's reads are followed by the first round of the epoch
    expected next: ``epoch + 1`` on a first iteration and in a ``set_epoch(epoch + 1)`` loop
    (the same epoch again, a validation loader, or a jump reads nothing ahead), unless this
    epoch fills the cache; it goes onward in a loop, unless this epoch fills the cache."""
    source = reader.source
    if source.cache is not None:  # shards cached since the last epoch are read from disk now
        source.epoch_starts(
            name=f"lakeshard-r{reader.options.rank}",
            expected=reader.ranges.remote_ranges(),
            settle_s=SETTLE_S,
        )
    fills = source.fills_cache()
    ahead = epoch + 1 if (looping or first_iteration) and not fills else None
    flow = Flow(at=(epoch, start), onward=looping and not fills)
    stop = threading.Event()
    first = start - (plan.first_index if plan else 0)
    tasks = _flow_tasks(reader, decoding, flow, stop, epoch=epoch, start=first, plan=plan, ahead=ahead)
    return runs.start(flow, tasks, stop)


def _flow_tasks(
    reader: WindowReader,
    decoding: BatchDecoding,
    flow: Flow,
    stop: threading.Event,
    *,
    epoch: int,
    start: int,
    plan: EpochPlan | None,
    ahead: int | None,
) -> Iterator[Keyed]:
    """The tasks of a flow, epoch after epoch (NOTE [ A loader's flow ]): batch ``start`` of
    ``plan`` (default: ``epoch``'s own) on, then each next epoch from its first batch while the
    flow goes onward. Runs on the reader thread; it must not keep the loader alive from that
    thread (its threads stop when it is collected)."""
    onward = False
    while True:
        parts: EpochParts = flow.parts(epoch)
        decode = decoding.for_epoch(epoch, parts.skipped)
        tasks = reader.tasks(epoch, start, stop, ahead, plan, onward=onward, reads=parts.reads[0])
        for task in tallied(tasks, parts.shuffle, reader.source.shard_rows, reader.source.groups):
            yield Keyed((-1, epoch, task.index), task, decode)
        if not flow.onward or stop.is_set():
            return
        epoch, start, plan, onward = epoch + 1, 0, None, True
        ahead = epoch + 1
