"""What a :class:`~loaders.MixedLoader` is given, checked before any read: its sources and
weights, ``samples_per_epoch``, and how the sources' labels and image sizes go together."""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, StorageError
from loaders._internal.source import ShardSource
from loaders.batch import PAD_LABEL

__all__ = [
    "LABEL_POLICIES",
    "alike",
    "check_every_source_has_rows",
    "label_space",
    "normalised",
    "parse_sources",
    "positive_samples",
    "relabelling",
    "same_dataset",
    "same_size",
]

#: ``"union"``: the label space is every label name of every source (sorted), each source's
#: labels mapped into it by name. ``"same"``: the sources must have the same label names.
LABEL_POLICIES = ("union", "same")


def parse_sources(sources: Any) -> list[tuple[str, float | None]]:
    """``sources`` as ``(uri, weight)`` pairs: each item a URI (weight: its rows) or a
    ``(uri, weight)`` pair with a positive weight; all weighted or none.

    Raises:
        ConfigError: naming the bad item.
    """
    if isinstance(sources, str | os.PathLike) or not isinstance(sources, Sequence) or not sources:
        raise ConfigError(f"sources must be a non-empty list of URIs or (URI, weight) pairs, got {sources!r}")
    out: list[tuple[str, float | None]] = []
    for i, item in enumerate(sources):
        if isinstance(item, str | os.PathLike):
            out.append((os.fspath(item), None))
            continue
        if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[0], str | os.PathLike)):
            raise ConfigError(f"sources[{i}] must be a URI or a (URI, weight) pair, got {item!r}")
        weight = item[1]
        # numbers.Real: numpy's and Python's numbers alike (np.float32 is no float subclass).
        ok = isinstance(weight, numbers.Real) and not isinstance(weight, bool | np.bool_)
        if not ok or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"sources[{i}] ({item[0]}): weight must be a positive number, got {weight!r}")
        out.append((os.fspath(item[0]), float(weight)))
    weighted = [w is not None for _, w in out]
    if any(weighted) and not all(weighted):
        raise ConfigError(
            "give every source a weight or none (then each weighs its rows): "
            + ", ".join(f"{u} ({'weight ' + str(w) if w is not None else 'no weight'})" for u, w in out)
        )
    twice = same_dataset([u for u, _ in out])
    if twice is not None:
        first, second, root = twice
        raise ConfigError(
            f"sources[{first}] ({out[first][0]}) and sources[{second}] ({out[second][0]}) are the same "
            f"dataset, {root}: list each dataset once (sum its weights), or its rows would come twice "
            "in an epoch and its evaluation channels be counted twice"
        )
    return out


def same_dataset(uris: Sequence[str]) -> tuple[int, int, str] | None:
    """The first two of ``uris`` that name one dataset however spelt (a path, ``file://``, a
    trailing slash), and that dataset's URI; None when all differ. No I/O."""
    seen: dict[str, int] = {}
    for i, uri in enumerate(uris):
        try:
            root = storage.normalize(uri)
        except StorageError:
            continue  # not a URI: opening it says why
        if root in seen:
            return seen[root], i, root
        seen[root] = i
    return None


def positive_samples(samples_per_epoch: Any) -> int:
    """``samples_per_epoch`` as an int: a positive integer of Python's or numpy's."""
    if isinstance(samples_per_epoch, bool | np.bool_) or not isinstance(samples_per_epoch, numbers.Integral):
        raise ConfigError(f"samples_per_epoch must be a positive integer, got {samples_per_epoch!r}")
    if samples_per_epoch < 1:
        raise ConfigError(f"samples_per_epoch must be a positive integer, got {samples_per_epoch!r}")
    return operator.index(samples_per_epoch)


def normalised(raw: list[float]) -> list[float]:
    """``raw`` weights scaled to sum to 1, scaled by the largest first (1e308 + 1e308 overflows)."""
    top = max(raw)
    scaled = [w / top for w in raw]
    return [w / sum(scaled) for w in scaled]


def check_every_source_has_rows(
    parsed: list[tuple[str, float | None]], weights: list[float], per_source: list[int], samples: int
) -> None:
    """Refuse a source that gets no row in an epoch: the shares are the same every epoch, so it
    would never be read. Names the smallest weight that gets a row (an exact share of 1 or more:
    ``w / (w + others) * samples >= 1``)."""
    for i, ((uri, given), weight, n) in enumerate(zip(parsed, weights, per_source, strict=True)):
        if n > 0:
            continue
        if given is None:  # weighed by its rows
            need = f"give the sources weights, the smallest at least 1/{samples} of their sum"
        else:
            others = sum(w for j, (_, w) in enumerate(parsed) if j != i and w is not None)
            least = _round_up(others / (samples - 1)) if samples > 1 else math.inf
            need = f"give it a weight of at least {least:g} (the smallest that gets a row, the others' as they are)"
        more = f"samples_per_epoch of at least {math.ceil(1 / weight)}" if weight > 0 else "larger weights"
        raise ConfigError(
            f"source {uri} ({'weight ' + format(given, 'g') if given is not None else 'weighed by its rows'}, "
            f"{weight:.3g} of the mixture) gets 0 of the {samples} samples of every epoch: {need}, or {more}"
        )


def _round_up(x: float) -> float:
    """``x`` rounded up to 3 significant digits (a bound that printing must not lower)."""
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return math.ceil(x / step) * step


def alike(sources: Sequence[ShardSource]) -> None:
    """A mixture's sources are of one task kind with the same label columns (kept ones
    included, of the same Arrow types): sources that differ are refused naming both.

    Raises:
        DatasetError: naming the first two sources that differ.
    """
    first = sources[0]
    for src in sources[1:]:
        if (src.info.task_kind, src.info.columns) != (first.info.task_kind, first.info.columns):
            raise DatasetError(
                f"sources {first.dataset} ({_kind(first)}) and {src.dataset} ({_kind(src)}) differ in task "
                "or columns: a mixture's sources must be alike"
            )


def _kind(src: ShardSource) -> str:
    columns = ", ".join(src.info.columns or {})
    return f"{src.info.task_kind}, columns {columns}" if columns else src.info.task_kind


def same_size(sources: Sequence[ShardSource], crop: int | None) -> int:
    """The image size every source yields; refuses sources of different sizes without ``crop``,
    and a ``crop`` larger than a source's images."""
    sizes = {src.dataset: src.info.image.size for src in sources}
    if crop is not None:
        for size in sizes.values():
            if crop > size:
                raise ConfigError(f"crop must be at most the image size {size}, got {crop!r}")
        return crop
    if len(set(sizes.values())) > 1:
        raise DatasetError(
            "the sources have images of different sizes ("
            + ", ".join(f"{u}: {s} px" for u, s in sizes.items())
            + "): pass crop=N (at most the smallest) so every batch has one size"
        )
    return next(iter(sizes.values()))


def relabelling(theirs: dict[str, int], space: dict[str, int]) -> torch.Tensor | None:
    """The map from a dataset's label indices (``theirs``: name -> index) to those of ``space``;
    ``None`` where they are the same."""
    if all(space.get(n) == i for n, i in theirs.items()):
        return None
    lut = torch.full((max(theirs.values(), default=-1) + 1,), PAD_LABEL, dtype=torch.int64)
    for name, index in theirs.items():
        lut[index] = space[name]
    return lut


def label_space(
    sources: Sequence[ShardSource], policy: str
) -> tuple[dict[str, int], list[torch.Tensor | None]]:
    """One label space for all sources (name -> index) and, per source, the map from its label
    index to the space's (``None`` where they are the same)."""
    names = [src.info.labels for src in sources]
    if policy == "same":
        for ld, theirs in zip(sources[1:], names[1:], strict=True):
            if set(theirs) != set(names[0]):
                only_first = sorted(set(names[0]) - set(theirs))
                only_this = sorted(set(theirs) - set(names[0]))
                raise DatasetError(
                    f'labels="same": {ld.dataset} has other label names than {sources[0].dataset} '
                    f"(only in {sources[0].dataset}: {only_first or 'none'}; only in {ld.dataset}: "
                    f'{only_this or "none"}); pass labels="union" to train on all of them'
                )
    space = {name: i for i, name in enumerate(sorted({n for m in names for n in m}))}
    return space, [relabelling(mapping, space) for mapping in names]
