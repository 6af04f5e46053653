"""A :class:`~loaders.MixedLoader`'s saved state: its format and the checks before a resume.

Format ``lakeshard.MixedLoader/1`` (the same on every rank, so rank 0's copy resumes them all)::

    {"format": "lakeshard.MixedLoader/1",
     "sources": [{"dataset": "s3://...", "dataset_version": "<hex>", "weight": 0.7}, ...],
     "channel": "train", "samples_per_epoch": 100000, "epoch": 3, "batches_consumed": 17,
     "legs": [{"world_size": 2, "batch_size": 64, "batches": 17}],
     "order": {"shuffle": true, "seed": 7, "shuffle_window": 2048}}

``legs`` as a single loader's (:mod:`loaders._internal.state`): the parts of the epoch run at one world
size each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lakeshard.errors import DatasetError, LoaderError
from loaders._internal.elastic import Leg
from loaders._internal.mixing import MixPlan
from loaders._internal.state import MIX_STATE_FORMAT, check_global_batch, parse_legs

__all__ = ["MIX_ORDER", "MixIdentity", "SavedMix", "mix_state_dict", "read_mix_state"]

#: The options a mixture's state must match (with its sources and ``samples_per_epoch``).
MIX_ORDER = ("shuffle", "seed", "shuffle_window")


@dataclass(frozen=True)
class MixIdentity:
    """What a mixture's state must match: its sources (in order), their versions and weights,
    the channel, ``samples_per_epoch``, the order settings; and its plan's inputs."""

    sources: tuple[str, ...]
    versions: tuple[str, ...]
    weights: tuple[float, ...]
    channel: str
    samples_per_epoch: int
    order: Mapping[str, Any]
    per_source: tuple[int, ...]
    rows: tuple[int, ...]


@dataclass(frozen=True)
class SavedMix:
    """Where a mixture resumes: the epoch, its legs before the current one, the batches consumed."""

    epoch: int
    legs_before: tuple[Leg, ...]
    consumed: int


def mix_state_dict(mix: MixIdentity, *, epoch: int, legs: list[Leg]) -> dict[str, Any]:
    """A mixture's state (the same on every rank): see the module docstring."""
    return {
        "format": MIX_STATE_FORMAT,
        "sources": _source_records(mix),
        "channel": mix.channel,
        "samples_per_epoch": mix.samples_per_epoch,
        "epoch": epoch,
        "batches_consumed": sum(leg.batches for leg in legs),
        "legs": [dataclasses.asdict(leg) for leg in legs],
        "order": dict(mix.order),
    }


def _source_records(mix: MixIdentity) -> list[dict[str, Any]]:
    return [
        {"dataset": uri, "dataset_version": version, "weight": weight}
        for uri, version, weight in zip(mix.sources, mix.versions, mix.weights, strict=True)
    ]


def read_mix_state(state: Any, mix: MixIdentity, *, world_size: int, batch_size: int) -> SavedMix:
    """Where a mixture resumes from ``state``, at ``world_size`` ranks of ``batch_size``.

    Raises:
        DatasetError: a source was rebuilt since (another dataset version).
        LoaderError: not a mixture state, a malformed one, other sources (or the same in another
            order), weights, ``samples_per_epoch`` or order settings, or another global batch.
    """
    if not isinstance(state, dict) or state.get("format") != MIX_STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise LoaderError(f"not a MixedLoader state (format {got!r}, expected {MIX_STATE_FORMAT!r})")
    _check_sources(state.get("sources"), mix)
    if state.get("channel") != mix.channel:
        raise LoaderError(
            f"mixture state is for channel {state.get('channel')!r}, this loader reads {mix.channel!r}"
        )
    legs = parse_legs(state.get("legs"))
    consumed = state.get("batches_consumed")
    if consumed != sum(x.batches for x in legs) or isinstance(consumed, bool):
        raise LoaderError(
            f"mixture state legs {state.get('legs')!r} do not add up to its batches_consumed {consumed!r}"
        )
    last = legs[-1]
    # The global batch first: samples_per_epoch is rounded to it, so another global batch
    # would show as another samples_per_epoch.
    check_global_batch(last, world_size=world_size, batch_size=batch_size)
    if state.get("samples_per_epoch") != mix.samples_per_epoch:
        raise LoaderError(
            f"cannot resume: the mixture state was saved with samples_per_epoch {state.get('samples_per_epoch')!r}, "
            f"this loader has {mix.samples_per_epoch}"
        )
    mine = dict(mix.order)
    order = state.get("order")
    theirs = order if isinstance(order, dict) else {}
    diff = [f"{k}: saved {theirs.get(k)!r}, now {v!r}" for k, v in mine.items() if theirs.get(k) != v]
    if diff:
        raise LoaderError(
            f"cannot resume: the mixture state was saved with other settings ({', '.join(diff)})"
        )
    epoch = state.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise LoaderError(f"mixture state epoch must be a non-negative integer, got {epoch!r}")
    same = last.world_size == world_size
    before = legs[:-1] if same else legs
    try:  # checks every leg, the last one's batches too (past the epoch's end: refused)
        MixPlan(mix.per_source, mix.rows, epoch, legs if same else [*legs, Leg(world_size, batch_size, 0)])
    except LoaderError as exc:
        raise LoaderError(
            f"cannot resume: the mixture state's legs {state.get('legs')!r} do not fit its epoch: {exc}"
        ) from None
    return SavedMix(epoch, tuple(before), consumed)


def _check_sources(saved: Any, mix: MixIdentity) -> None:
    """Refuse a state of other sources, weights, or a source rebuilt since, naming which."""
    mine = _source_records(mix)
    if not isinstance(saved, list) or not all(isinstance(s, dict) for s in saved):
        raise LoaderError(f"mixture state has no list of sources, got {saved!r}")
    names = [s.get("dataset") for s in saved]
    if names != [s["dataset"] for s in mine] and sorted(map(str, names)) == sorted(mix.sources):
        raise LoaderError(
            f"cannot resume: the mixture state mixes {', '.join(map(str, names))} in that order and this "
            f"loader mixes {', '.join(mix.sources)}: the same sources in another order, which is "
            "another mixture (each source's rows are dealt by its position); pass them in the saved order"
        )
    if names != [s["dataset"] for s in mine]:
        raise LoaderError(
            "cannot resume: the mixture state was saved on sources "
            f"{[s.get('dataset') for s in saved]}, this loader mixes {[s['dataset'] for s in mine]}"
        )
    for old, new in zip(saved, mine, strict=True):
        if old.get("dataset_version") != new["dataset_version"]:
            raise DatasetError(
                f"refusing to resume: source {new['dataset']} was version {old.get('dataset_version')!r} "
                f"when the mixture state was saved and is now {new['dataset_version']!r}; start a new run "
                "(or restore the old dataset)"
            )
        weight = old.get("weight")
        if not isinstance(weight, float | int) or not math.isclose(weight, new["weight"], rel_tol=1e-9):
            raise LoaderError(
                f"cannot resume: source {new['dataset']} had weight {weight!r} when the mixture state was "
                f"saved, now {new['weight']!r}"
            )
