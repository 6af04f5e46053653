"""Where a training process runs: its rank among the others, its device, and the collectives the
trainer makes over the ranks (plain calls on one process).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; without them the
run is one process (:meth:`Ranks.from_env`). :func:`loaders.train.loop.main` picks the device
and joins the process group (:class:`World`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lakeshard.errors import ConfigError

__all__ = ["Ranks", "World", "all_gather", "all_reduce", "any_rank", "gather", "info_level"]


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place in the run as torchrun's environment says it (one process without it)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    #: Started by torchrun (``WORLD_SIZE`` is set): in a process group even when alone, so that
    #: ``torchrun --nproc_per_node=1`` runs the collectives (nccl on a GPU) that more ranks would.
    launched: bool = False

    @classmethod
    def from_env(cls) -> Ranks:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``.

        Raises:
            ConfigError: one is not a non-negative integer, or ``WORLD_SIZE`` is 0.
        """
        world = _env_int("WORLD_SIZE", 1)
        if world < 1:
            raise ConfigError(f"environment variable WORLD_SIZE must be at least 1, got {world}")
        return cls(
            _env_int("RANK", 0),
            world,
            _env_int("LOCAL_RANK", 0),
            _env_int("LOCAL_WORLD_SIZE", world),
            launched="WORLD_SIZE" in os.environ,
        )


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"environment variable {name} must be a non-negative integer, got {raw!r} (set by torchrun)"
        )
    return value


@dataclass(frozen=True, slots=True)
class World:
    """Where this process trains: rank ``rank`` of ``world_size`` (``local_rank`` of
    ``local_world_size`` on its host), on ``device``; in a process group when ``active`` (several
    ranks, or ``grouped``: one rank that torchrun started)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    grouped: bool = False

    @property
    def active(self) -> bool:
        return self.world_size > 1 or self.grouped

    def autocast(self, bf16: bool) -> torch.autocast:
        """The forward pass's precision on this device: bfloat16 autocast, or none."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)


def all_reduce(values: list[float], world: World, *, maximum: bool = False) -> list[float]:
    """``values`` summed (or their ``maximum``) over every rank, as float64; ``values`` on one process."""
    device = world.device if world.device.type == "cuda" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world.active:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM)
    return t.tolist()


def any_rank(flag: bool, world: World) -> bool:
    """Whether ``flag`` holds on any rank (one all-reduce: every rank calls it)."""
    (found,) = all_reduce([1.0 if flag else 0.0], world, maximum=True)
    return found > 0


def gather(value: Any, world: World) -> list[Any]:
    """Every rank's ``value`` (any picklable object), by rank."""
    if not world.active:
        return [value]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, value)
    return out


def all_gather(value: float, world: World) -> list[float]:
    """Every rank's ``value``, by rank."""
    if not world.active:
        return [value]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def info_level(world: World) -> int:
    """What every rank does alike is logged by rank 0 (the others log it at DEBUG)."""
    return logging.INFO if world.rank == 0 else logging.DEBUG
