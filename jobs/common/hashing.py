"""Seeded randomness without a random generator: a number in [0, 1) per tuple of values, the
same on every process, machine and Python version. The split (:mod:`jobs.manifest_steps.split`)
and the shard plan (:mod:`jobs.shard_steps.deal`) draw every random choice from it, so a choice
depends on ``(seed, key, ...)`` alone, never on the order rows arrive in."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["unit_hash", "unit_hashes"]


def unit_hash(*parts: object) -> float:
    """A number in [0, 1) that depends only on ``parts`` (blake2b, stable across processes,
    machines and Python versions, unlike ``hash()``)."""
    text = "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def unit_hashes(
    head: Sequence[object], keys: Iterable[str], tails: Iterable[object] | None = None
) -> np.ndarray:
    """``unit_hash(*head, key)`` for each of ``keys`` (``unit_hash(*head, key, tail)`` with
    ``tails``, one per key), the same numbers, as float64: the shared ``head`` is encoded once
    and the digests are turned into numbers by numpy (uint64 to float64 rounds to nearest as
    ``int / float`` does; the division by 2**64 is exact)."""
    blake2b = hashlib.blake2b
    prefix = "\x1f".join([*(str(p) for p in head), ""]).encode("utf-8", "surrogatepass")
    if tails is None:
        digests = [blake2b(prefix + k.encode("utf-8", "surrogatepass"), digest_size=8).digest() for k in keys]
    else:
        digests = [
            blake2b(prefix + f"{k}\x1f{t}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
            for k, t in zip(keys, tails, strict=True)
        ]
    return np.frombuffer(b"".join(digests), dtype=">u8").astype(np.float64) / 2.0**64
