"""A mixture's sources opened: each read as a world-size-1 loader of it would (its reader, its
remote reads and cache started, ``memory_budget`` shared out by weight) and decoded as that
loader would; and, where rows decode alone, the decoding of whole mixture batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loaders._internal.batch_decoding import BatchDecoding, resolve_transform
from loaders._internal.buffers import BufferPool
from loaders._internal.mix_pipeline import MixSource
from loaders._internal.plan import num_batches, rank_segments, split_pieces
from loaders._internal.prep import PrepCluster
from loaders._internal.source import ShardSource
from loaders._internal.window_reader import WindowReader
from loaders.options import LoaderOptions
from loaders.stats import DecodeTally

__all__ = ["open_mix_sources"]


def open_mix_sources(
    opened: Sequence[ShardSource],
    luts: Sequence[torch.Tensor | None],
    weights: Sequence[float],
    opts: LoaderOptions,
    *,
    tally: DecodeTally,
    prep: PrepCluster | None,
    num_classes: int,
    image_size: int,
) -> tuple[list[MixSource], BatchDecoding | None]:
    """Each source of ``opened`` (its labels mapped by ``luts``) as a :class:`MixSource`; and the
    decoding of whole mixture batches when rows decode alone (no transform, no preparation
    cluster, one label space), else ``None``."""
    # Blocks in use at once: one per decode thread, ``prefetch`` queued, the one the reader
    # holds, the one being handed over, the training loop's previous batch, and the batch
    # of each source in hand.
    blocks = opts.decode_threads + opts.prefetch + 3
    buffers = BufferPool(keep=blocks + len(luts))
    name = f"lakeshard-r{opts.rank}"
    transform, reference = resolve_transform(opts)
    mix = []
    for i, (src, lut, weight) in enumerate(zip(opened, luts, weights, strict=True)):
        reader = _source_reader(src, opts, weight, len(luts), blocks, f"{name}-s{i}")
        decoding = BatchDecoding(
            reader.options,
            image_size=src.info.image.size,
            num_classes=src.info.num_classes,
            shard_uris=src.shard_uris,
            rank=0,
            transform=transform,
            transform_ref=reference,
            buffers=buffers,
            tally=tally,
            prep=prep,
            task=src.info.task,
        )
        mix.append(MixSource(src, reader, decoding, lut))
    # Rows that decode alone (no transform, one label space): each mixture batch is one task,
    # its rows decoded once straight into its block (the same pixels as in their source
    # batches); otherwise source batches are decoded and their rows copied together.
    if transform is not None or prep is not None:
        return mix, None
    if not all(m.lut is None and m.source.info.num_classes == num_classes for m in mix):
        return mix, None
    direct = BatchDecoding(
        opts,
        image_size=image_size,
        num_classes=num_classes,
        shard_uris=tuple(uri for m in mix for uri in m.source.shard_uris),
        rank=opts.rank,
        transform=None,
        transform_ref=None,
        buffers=buffers,
        tally=tally,
        task=opened[0].info.task,
    )
    return mix, direct


def _source_reader(
    src: ShardSource, opts: LoaderOptions, weight: float, n: int, blocks: int, name: str
) -> WindowReader:
    """``src`` read as a world-size-1 loader of it would: every shard, its row groups in its own
    order; its remote reads and cache started (``memory_budget`` shared out by weight among
    ``n`` sources)."""
    budget = opts.memory_budget_bytes
    options = opts.replace(
        rank=0,
        world_size=1,
        drop_last=False,
        remainder="pad",
        memory_budget=None if budget is None else max(1, int(budget * weight)) if n > 1 else budget,
    )
    groups = src.read_footers(
        list(range(len(src.shard_rows))), concurrency=opts.read_plan.footer_threads, name=name
    )
    segments = rank_segments(src.shard_rows, 1, 0, remainder="pad")
    reader = WindowReader(
        src,
        options,
        pieces=split_pieces(segments, groups),
        num_batches=num_batches(src.total_rows, opts.batch_size, drop_last=False),
        rows_per_rank=src.total_rows,
    )
    fetcher = src.start_reads(concurrency=opts.read_plan.in_flight, name=name)
    if fetcher is not None:
        fetcher.budget = reader.ranges.read_budget(
            blocks=blocks, image_size=src.info.image.size, dataset=src.dataset
        )
        if opts.cache_dir is not None:
            src.open_cache(opts.cache_dir, limit=opts.cache_limit_bytes)
    return reader
