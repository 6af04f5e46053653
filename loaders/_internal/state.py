"""A :class:`~loaders.ShardLoader`'s saved state: its format, the older format it still reads,
and the checks a state must pass before a loader resumes from it.

Format 2 (the same on every rank, so rank 0's copy resumes them all, at any world size)::

    {"format": "lakeshard.ShardLoader/2", "dataset": "s3://...", "dataset_version": "<hex>",
     "channel": "train", "epoch": 3, "batches_consumed": 17,
     "legs": [{"world_size": 2, "batch_size": 64, "batches": 12},
              {"world_size": 4, "batch_size": 32, "batches": 5}],
     "order": {"shuffle": true, "seed": 7, "drop_last": false, "remainder": "pad",
               "shuffle_window": 2048}}

``legs`` are the parts of the epoch run at one world size each (:mod:`loaders._internal.elastic`): the
first is the epoch's fresh start, each resume at another world size adds one, and
``batches_consumed`` (the global steps of the epoch so far) is the sum of their ``batches``.
Format 1 (``lakeshard.ShardLoader/1``: one world size per epoch, ``world_size``, ``batch_size``
and ``rows_per_rank`` under ``order``) is read as a state of one leg; saved mid-epoch with
``shuffle`` on it is refused, since the shuffle of an epoch's first windows changed since
(docs/design/0009).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lakeshard.errors import DatasetError, LoaderError
from loaders._internal.elastic import Leg

__all__ = [
    "MIX_STATE_FORMAT",
    "ORDER_SETTINGS",
    "STATE_FORMAT",
    "SavedState",
    "check_global_batch",
    "last_leg",
    "read_state",
    "state_dict",
]

STATE_FORMAT = "lakeshard.ShardLoader/2"
#: A :class:`~loaders.MixedLoader`'s state: its legs are a single loader's (:mod:`loaders.mixed_loader`).
MIX_STATE_FORMAT = "lakeshard.MixedLoader/1"
_FORMAT_1 = "lakeshard.ShardLoader/1"

#: The options that decide an epoch's rows and order whatever the world size: a state saved with
#: other values is refused.
ORDER_SETTINGS = ("shuffle", "seed", "drop_last", "remainder", "shuffle_window")


@dataclass(frozen=True, slots=True)
class SavedState:
    epoch: int
    legs: tuple[Leg, ...]

    @property
    def batches_consumed(self) -> int:
        return sum(leg.batches for leg in self.legs)


def state_dict(
    *, dataset: str, dataset_version: str, channel: str, epoch: int, legs: list[Leg], order: dict[str, Any]
) -> dict[str, Any]:
    """A format-2 state (see the module docstring)."""
    return {
        "format": STATE_FORMAT,
        "dataset": dataset,
        "dataset_version": dataset_version,
        "channel": channel,
        "epoch": epoch,
        "batches_consumed": sum(leg.batches for leg in legs),
        "legs": [
            {"world_size": leg.world_size, "batch_size": leg.batch_size, "batches": leg.batches}
            for leg in legs
        ],
        "order": {k: order[k] for k in ORDER_SETTINGS},
    }


def read_state(
    state: Any, *, dataset: str, dataset_version: str, channel: str, order: dict[str, Any], rows_per_rank: Any
) -> SavedState:
    """The epoch and legs of ``state`` (format 2, or 1 converted), after checking it was saved on
    this dataset version and channel with these ``order`` settings.

    ``rows_per_rank(world_size)``: this dataset's rows per rank at a world size (format 1 states
    recorded it; a mismatch is refused like any other changed setting).

    Raises:
        DatasetError: the state was saved on another dataset version.
        LoaderError: not a loader state, another channel, other order settings, bad legs.
    """
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (STATE_FORMAT, _FORMAT_1):
        got = fmt if isinstance(state, dict) else type(state).__name__
        raise LoaderError(
            f"not a ShardLoader state (format {got!r}, expected {STATE_FORMAT!r} or {_FORMAT_1!r})"
        )
    if state.get("dataset_version") != dataset_version:
        raise DatasetError(
            f"refusing to resume: the loader state was saved on dataset version {state.get('dataset_version')!r} "
            f"({state.get('dataset')}), but {dataset} is now version {dataset_version!r}; "
            "start a new run (or restore the old dataset)"
        )
    if state.get("channel") != channel:
        raise LoaderError(
            f"loader state is for channel {state.get('channel')!r}, this loader reads {channel!r}"
        )
    theirs = state.get("order")
    if not isinstance(theirs, dict):
        raise LoaderError(f"loader state has no 'order' settings, got {theirs!r}")
    mine = {k: order[k] for k in ORDER_SETTINGS}
    legs_raw = _raw_legs(state)
    legs = parse_legs(legs_raw)
    if fmt == _FORMAT_1:
        mine["rows_per_rank"] = rows_per_rank(legs[0].world_size)
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
        raise LoaderError(f"cannot resume: the loader state was saved with other settings ({detail})")
    epoch = state.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise LoaderError(f"loader state epoch must be a non-negative integer, got {epoch!r}")
    saved = SavedState(epoch, legs)
    if fmt == _FORMAT_1 and theirs.get("shuffle") and saved.batches_consumed:
        # Format 1 came from releases whose windows did not ramp up at an epoch's start
        # (docs/design/0009): the rest of that epoch would be other rows than it had left.
        raise LoaderError(
            f"cannot resume: this loader state (format {_FORMAT_1!r}) was saved in the middle of epoch {epoch} "
            f"(after {saved.batches_consumed} batches) by an earlier release, whose shuffle put other rows in the "
            "rest of the epoch; resume from a checkpoint taken at the end of an epoch, or start the epoch again"
        )
    if state.get("batches_consumed") != saved.batches_consumed:
        raise LoaderError(
            f"loader state batches_consumed is {state.get('batches_consumed')!r}, but its legs consumed "
            f"{saved.batches_consumed} batches ({legs_raw})"
        )
    return saved


def last_leg(state: Any) -> Leg:
    """The world size and batch size ``state`` (format 2 or 1, or a mixture's) was last run at,
    without checking it against a dataset: what a trainer needs to choose its batch size before
    any loader.

    Raises:
        LoaderError: not a loader state.
    """
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (STATE_FORMAT, _FORMAT_1, MIX_STATE_FORMAT):
        raise LoaderError(
            f"not a ShardLoader state (format {fmt!r}, expected {STATE_FORMAT!r} or {_FORMAT_1!r})"
        )
    return parse_legs(_raw_legs(state))[-1]


def _raw_legs(state: dict[str, Any]) -> Any:
    """The legs of a state as saved; a format-1 state has one (its settings under ``order``)."""
    if state.get("format") == _FORMAT_1:
        order = state.get("order")
        if not isinstance(order, dict):
            order = {}
        return [
            {
                "world_size": order.get("world_size"),
                "batch_size": order.get("batch_size"),
                "batches": state.get("batches_consumed"),
            }
        ]
    return state.get("legs")


def parse_legs(raw: Any) -> tuple[Leg, ...]:
    """The legs of a state as saved, checked: a non-empty list of legs of sizes >= 1.

    Raises:
        LoaderError: naming the bad leg and the form a leg takes.
    """
    if not isinstance(raw, list) or not raw:
        raise LoaderError(f"loader state legs must be a non-empty list, got {raw!r}")
    legs = []
    for i, leg in enumerate(raw):
        ok = (
            isinstance(leg, dict)
            and set(leg) == {"world_size", "batch_size", "batches"}
            and all(isinstance(v, int) and not isinstance(v, bool) for v in leg.values())
        )
        if not ok or leg["world_size"] < 1 or leg["batch_size"] < 1 or leg["batches"] < 0:
            raise LoaderError(
                f"loader state leg {i} must be {{'world_size': int >= 1, 'batch_size': int >= 1, 'batches': int >= 0}}, got {leg!r}"
            )
        legs.append(Leg(leg["world_size"], leg["batch_size"], leg["batches"]))
    return tuple(legs)


def check_global_batch(saved: Leg, *, world_size: int, batch_size: int) -> None:
    """A state saved by ``saved.world_size`` ranks of ``saved.batch_size`` resumes at
    ``world_size`` ranks only with the same global batch.

    Raises:
        LoaderError: naming the saved sizes and the batch size (or world sizes) that would work.
    """
    g = saved.global_batch
    if world_size * batch_size == g:
        return
    head = (
        f"cannot resume: the loader state was saved by {saved.world_size} rank(s) x batch_size {saved.batch_size} "
        f"= global batch {g}, this loader has {world_size} rank(s) x batch_size {batch_size} = {world_size * batch_size}"
    )
    if g % world_size == 0:
        raise LoaderError(
            f"{head}; pass batch_size={g // world_size} to continue the epoch with the same global batch"
        )
    works = [d for d in range(1, g + 1) if g % d == 0]
    raise LoaderError(
        f"{head}; a global batch of {g} cannot be split over {world_size} ranks: resume on a world size that "
        f"divides it ({', '.join(map(str, works))})"
    )
