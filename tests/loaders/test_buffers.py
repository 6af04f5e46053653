"""The batch buffer pool: a block is handed out again only once nothing can reach it."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from loader_builders import ids_of, write_dataset

from loaders import ShardLoader
from loaders._internal.buffers import BufferPool


@pytest.mark.slow  # a full garbage collection per view
def test_a_block_comes_back_only_when_its_last_view_is_gone():
    pool = BufferPool(keep=4)
    a = pool.take((2, 3, 3, 3))
    a[...] = 7
    address = a.ctypes.data
    # What decode_batch and a training loop may make of it: a permuted tensor, numpy views.
    holders = [torch.from_numpy(a).permute(0, 3, 1, 2), a[1], a[:, ::-1], torch.from_numpy(a).numpy()[0]]
    del a
    others = set()
    while holders:
        gc.collect()
        b = pool.take((2, 3, 3, 3))
        assert b.ctypes.data != address  # still reachable: never handed out again
        others.add(b.ctypes.data)
        b[...] = 0
        del b
        assert all(int(h.min()) == 7 for h in holders)
        holders.pop()
    gc.collect()
    c = pool.take((2, 3, 3, 3))
    assert c.shape == (2, 3, 3, 3) and c.dtype == np.uint8 and c.flags.c_contiguous and c.flags.writeable
    assert pool.allocated == 2 and len(others) == 1  # the first block, and one reused by every later take()
    assert c.ctypes.data in {address, *others}


def test_the_pool_keeps_at_most_keep_free_blocks():
    pool = BufferPool(keep=2)
    arrays = [pool.take((4,)) for _ in range(5)]
    assert pool.allocated == 5
    del arrays
    gc.collect()
    again = [pool.take((4,)) for _ in range(5)]
    assert pool.allocated == 5 + 3  # two came from the pool, three were allocated anew
    assert len({x.ctypes.data for x in again}) == 5


def test_batches_the_loop_keeps_stay_intact_while_the_others_are_reused(tmp_path: Path):
    write_dataset(tmp_path, rows={"train": 60, "validation": 4, "test": 4}, num_shards=2)
    loader = ShardLoader(str(tmp_path), batch_size=4, num_threads=3, prefetch=2)
    kept = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        for i, (images, _) in enumerate(loader):
            if i % 3 == 0:
                kept.append((epoch, i, images))  # the rest is dropped at once and reused
    for epoch, i, images in kept:
        assert ids_of(images) == list(range(4 * i, 4 * i + 4)), (epoch, i)
    assert loader.batch_decoding.buffers.allocated < 3 * len(loader)
