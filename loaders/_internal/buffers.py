"""Reusable memory for decoded batches.

A 64 x 224 x 224 x 3 batch is 9.2 MiB. Allocated fresh for every batch and freed by the training
loop (another thread than the one that allocated it), glibc often hands it back to the kernel and
the next batch page-faults it in again. A pool hands out the same blocks again instead.

A block is reused only once nothing can reach it. Each ``take()`` wraps the block in a new
*lease* object that exports its memory (``__array_interface__``), and the array handed out is
made from the lease, so the lease is that array's ``base``. Every view of it (numpy's and
torch's, ``torch.from_numpy`` included) keeps its base alive, so the lease dies only when the
last array or tensor over the block does; a ``weakref.finalize`` on it then puts the block back.
A batch the training loop keeps forever keeps its block forever; the pool allocates another.

Invariant: free blocks <= ``keep`` per block size, so what the pool holds is bounded by
``keep`` batches whatever the shard's size.
"""

from __future__ import annotations

import threading
import weakref
from math import prod

import numpy as np

__all__ = ["BufferPool"]


class _Lease:
    """Exports a block's memory as a uint8 array of ``shape``; the block goes back to the pool
    when this object dies (so only once no array over it is left)."""

    __slots__ = ("__array_interface__", "__weakref__", "block")

    def __init__(self, block: np.ndarray, shape: tuple[int, ...]) -> None:
        self.block = block  # keeps the memory alive while any array over it is
        self.__array_interface__ = {
            "shape": shape,
            "typestr": "|u1",
            "data": (block.ctypes.data, False),
            "version": 3,
        }


class BufferPool:
    """Uint8 arrays backed by reused blocks; shared by the decode threads of one loader.

    Args:
        keep: how many free blocks of each size to keep for reuse (more are freed).
    """

    def __init__(self, *, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep must be a non-negative integer, got {keep!r}")
        self._keep = keep
        self._free: dict[int, list[np.ndarray]] = {}
        # Re-entrant: a lease may die (and give its block back) in a garbage collection that
        # runs while this thread is inside take().
        self._lock = threading.RLock()
        self.allocated = 0  # blocks allocated so far (the rest of take() calls reused one)

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised C-contiguous uint8 array of ``shape``."""
        nbytes = prod(shape)
        with self._lock:
            free = self._free.get(nbytes)
            block = free.pop() if free else None
            if block is None:
                self.allocated += 1
        if block is None:
            block = np.empty(nbytes, dtype=np.uint8)
        lease = _Lease(block, shape)
        weakref.finalize(lease, self._give_back, block).atexit = False
        return np.asarray(lease)

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault(block.nbytes, [])
            if len(free) < self._keep:
                free.append(block)
