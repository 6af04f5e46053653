"""``MixedLoader``: stream several datasets at once, each giving an exact share of every epoch.

```python
loader = MixedLoader([("s3://lake/datasets/pets-v3", 0.7), ("s3://lake/datasets/pets-hard", 0.3)],
                     channel="train", rank=rank, world_size=world, batch_size=64,
                     samples_per_epoch=100_000, shuffle=True, seed=7)
for epoch in range(epochs):
    loader.set_epoch(epoch)
    for images, labels in loader:   # labels in the union of the sources' label names
        ...
```

Which positions of which source each rank reads, and the order: :mod:`loaders.mixing`. Each
source is read by a :class:`~loaders.ShardLoader` of its own at world size 1 (its threads,
reads, cache and transform), started at the stream position the plan gives this rank; a batch
is the rows the plan gives it from each source, source after source. So the rows, their order
and their augmentation draws depend only on ``(seed, epoch)`` and the legs of the epoch, never
on which rank reads them or how fast.

State (``state_dict()``) is the same on every rank and resumes them all, at this world size or
another that keeps the global batch (``world_size * batch_size``), like a single dataset's:
the rest of an interrupted epoch is dealt evenly to the new ranks (:class:`~loaders.mixing.MixPlan`).
``load_state_dict`` refuses a state saved with another list of sources, other weights, another
``samples_per_epoch``, other order settings, or on a source rebuilt since (naming it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import operator
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lakeshard import format as contract
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, LoaderError, StorageError
from loaders.batch import PAD_LABEL
from loaders.buffers import BufferPool
from loaders.dataset import ShardDataset
from loaders.decode import NO_DECODER
from loaders.elastic import Leg
from loaders.mixing import MixPlan, Span, epoch_samples, locate, shares
from loaders.options import LoaderOptions
from loaders.shard_loader import ShardLoader
from loaders.state import MIX_STATE_FORMAT, check_global_batch, state_dict
from loaders.stats import LoaderStats, LoaderTotals

__all__ = ["LABEL_POLICIES", "Concatenated", "MixedLoader", "parse_sources", "relabelling", "same_dataset"]

log = logging.getLogger(__name__)

#: ``"union"``: the label space is every label name of every source (sorted), each source's
#: labels mapped into it by name. ``"same"``: the sources must have the same label names.
LABEL_POLICIES = ("union", "same")

#: The options a mixture's state must match (with its sources and ``samples_per_epoch``).
_ORDER = ("shuffle", "seed", "shuffle_window")


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


class MixedLoader:
    """Stream rank ``rank``'s share of a mixture of datasets as ``(images, labels)`` batches
    (``from loaders import MixedLoader``).

    Args:
        sources: the datasets: URIs, each weighing its rows in ``channel``, or ``(URI, weight)``
            pairs (positive weights, normalised to sum to 1).
        samples_per_epoch: samples of an epoch over all ranks (default: the rows of every source
            in ``channel``), rounded down to a whole number of global batches
            (``world_size * batch_size``); :attr:`samples_per_epoch` is the number used.
        labels: ``"union"`` (default: one label space of every source's label names, sorted) or
            ``"same"`` (refuse sources whose label names differ).
        **kwargs: the options of :class:`~loaders.ShardLoader` (``channel``, ``rank``,
            ``world_size``, ``batch_size``, ``shuffle``, ``seed``, threads, reads, cache,
            transform). Each source's loader has ``num_threads`` decode threads (a source
            waits for its rows only as long as the others take theirs, so a thread split by
            weight left the larger source short); ``memory_budget`` is shared out among the
            sources by weight. ``drop_last`` and ``remainder`` do not apply: every batch is full.

    Each epoch holds ``shares(weights, samples_per_epoch)`` rows of each source (each within one
    row of its exact share); each batch of a rank holds each source within one row of that
    rank's share of the epoch (:mod:`loaders.mixing`), the rows of one source together.
    ``len(loader)`` is the same on every rank; :attr:`source_rows` counts the rows this rank's
    current (or last) iteration took from each source (:attr:`per_source`: what an epoch takes
    over all ranks).
    """

    def __init__(
        self,
        sources: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], float]],
        *,
        samples_per_epoch: int | None = None,
        labels: str = "union",
        **kwargs: Any,
    ) -> None:
        parsed = parse_sources(sources)
        if labels not in LABEL_POLICIES:
            raise ConfigError(f"labels must be one of {LABEL_POLICIES}, got {labels!r}")
        for key in ("drop_last", "remainder"):
            if key in kwargs:
                raise ConfigError(
                    f"{key} does not apply to a mixture: every epoch is whole batches, on every rank"
                )
        self.options = opts = LoaderOptions.from_keywords(kwargs)
        if opts.decoder == NO_DECODER:
            raise ConfigError(
                'decoder="none" is not supported for a mixture yet: decode on the CPU, or load one dataset'
            )
        if samples_per_epoch is not None:
            samples_per_epoch = _positive_int(samples_per_epoch)
        self._loaders: list[ShardLoader] = []
        try:
            self._open(parsed, samples_per_epoch, labels)
        except BaseException:
            self.close()
            raise

    def _open(
        self, parsed: list[tuple[str, float | None]], samples_per_epoch: int | None, policy: str
    ) -> None:
        opts = self.options
        rows = [_channel_rows(uri, opts.channel) for uri, _ in parsed]
        raw = [w if w is not None else float(n) for (_, w), n in zip(parsed, rows, strict=True)]
        self.weights = _normalised(raw)
        # Memory follows each source's share of the samples.
        for (uri, _), weight in zip(parsed, self.weights, strict=True):
            self._loaders.append(ShardLoader(uri, options=self._source_options(weight, len(parsed))))
        self.image_size = _same_size(self._loaders, opts.crop)
        self.labels, self._luts = _label_space(self._loaders, policy)
        self.num_classes = len(self.labels)
        self.sources = tuple(ld.dataset for ld in self._loaders)
        self.source_versions = tuple(ld.dataset_version for ld in self._loaders)
        #: The sources' versions, joined: what changes whenever one of them is rebuilt.
        self.dataset_version = "+".join(self.source_versions)
        self.dataset = (
            "mix(" + ", ".join(f"{u}:{w:g}" for u, w in zip(self.sources, self.weights, strict=True)) + ")"
        )
        self.requested_samples = sum(rows) if samples_per_epoch is None else samples_per_epoch
        self.samples_per_epoch = epoch_samples(self.requested_samples, opts.world_size * opts.batch_size)
        if self.samples_per_epoch != self.requested_samples:
            log.info(
                "mixture: samples_per_epoch %d rounded down to %d (whole global batches of %d)",
                self.requested_samples,
                self.samples_per_epoch,
                opts.world_size * opts.batch_size,
            )
        self.per_source = shares(self.weights, self.samples_per_epoch)
        _check_every_source_has_rows(parsed, self.weights, self.per_source, self.samples_per_epoch)
        self._rows = rows
        self._streams = [_Stream(ld, lut) for ld, lut in zip(self._loaders, self._luts, strict=True)]
        self._epoch = 0
        self._legs_before: tuple[Leg, ...] = ()  # of self._epoch, before the current leg (a resume)
        self._next_start = 0
        self._consumed = 0
        self._resumed_used = False
        self.source_rows = [0] * len(self._loaders)
        self._began = [ld.totals() for ld in self._loaders]  # where the current iteration began
        self._batches_run = 0
        self._buffers = BufferPool(keep=3)  # the yielded batch, the loop's previous one, one spare

    def _source_options(self, weight: float, n: int) -> LoaderOptions:
        opts = self.options
        budget = opts.memory_budget
        return dataclasses.replace(
            opts,
            rank=0,
            world_size=1,
            drop_last=False,
            remainder="pad",
            memory_budget=None if budget is None else max(1, int(budget * weight)) if n > 1 else budget,
        )

    # -- epochs and state --------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def _plan(self) -> MixPlan:
        opts = self.options
        current = Leg(opts.world_size, opts.batch_size, 0)
        return MixPlan(self.per_source, self._rows, self._epoch, [*self._legs_before, current])

    def __len__(self) -> int:
        plan = self._plan()
        return plan.batches_before(len(plan.legs) - 1) + plan.num_batches(len(plan.legs) - 1)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration yields (keeps a restored position in that epoch)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch, self._next_start, self._consumed = epoch, 0, 0
            self._legs_before = ()

    def state_dict(self) -> dict[str, Any]:
        opts = self.options
        first = sum(leg.batches for leg in self._legs_before)
        legs = [*self._legs_before, Leg(opts.world_size, opts.batch_size, self._consumed - first)]
        return {
            "format": MIX_STATE_FORMAT,
            "sources": self._source_records(),
            "channel": opts.channel,
            "samples_per_epoch": self.samples_per_epoch,
            "epoch": self._epoch,
            "batches_consumed": sum(leg.batches for leg in legs),
            "legs": [dataclasses.asdict(leg) for leg in legs],
            "order": {k: opts.order_key()[k] for k in _ORDER},
        }

    def _source_records(self) -> list[dict[str, Any]]:
        return [
            {"dataset": uri, "dataset_version": version, "weight": weight}
            for uri, version, weight in zip(self.sources, self.source_versions, self.weights, strict=True)
        ]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off (see the module docstring).

        Raises:
            DatasetError: a source was rebuilt since (another dataset version).
            LoaderError: not a mixture state, other sources, weights, ``samples_per_epoch`` or
                order settings, or another global batch.
        """
        if not isinstance(state, dict) or state.get("format") != MIX_STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise LoaderError(f"not a MixedLoader state (format {got!r}, expected {MIX_STATE_FORMAT!r})")
        self._check_sources(state.get("sources"))
        opts = self.options
        if state.get("channel") != opts.channel:
            raise LoaderError(
                f"mixture state is for channel {state.get('channel')!r}, this loader reads {opts.channel!r}"
            )
        if state.get("samples_per_epoch") != self.samples_per_epoch:
            raise LoaderError(
                f"cannot resume: the mixture state was saved with samples_per_epoch {state.get('samples_per_epoch')!r}, "
                f"this loader has {self.samples_per_epoch}"
            )
        mine = {k: opts.order_key()[k] for k in _ORDER}
        theirs = state.get("order") if isinstance(state.get("order"), dict) else {}
        diff = [f"{k}: saved {theirs.get(k)!r}, now {v!r}" for k, v in mine.items() if theirs.get(k) != v]
        if diff:
            raise LoaderError(
                f"cannot resume: the mixture state was saved with other settings ({', '.join(diff)})"
            )
        epoch = state.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise LoaderError(f"mixture state epoch must be a non-negative integer, got {epoch!r}")
        legs = tuple(Leg(**leg) if isinstance(leg, dict) else leg for leg in state.get("legs") or ())
        if not legs or state.get("batches_consumed") != sum(x.batches for x in legs):
            raise LoaderError(
                f"mixture state legs {state.get('legs')!r} do not add up to its batches_consumed"
            )
        last = legs[-1]
        check_global_batch(last, world_size=opts.world_size, batch_size=opts.batch_size)
        before = legs[:-1] if last.world_size == opts.world_size else legs
        MixPlan(
            self.per_source, self._rows, epoch, [*before, Leg(opts.world_size, opts.batch_size, 0)]
        )  # checks the legs
        consumed = sum(x.batches for x in legs)
        self._epoch, self._legs_before = epoch, before
        self._next_start = self._consumed = consumed
        self._resumed_used = False

    def _check_sources(self, saved: Any) -> None:
        """Refuse a state of other sources, weights, or a source rebuilt since, naming which."""
        mine = self._source_records()
        if not isinstance(saved, list) or not all(isinstance(s, dict) for s in saved):
            raise LoaderError(f"mixture state has no list of sources, got {saved!r}")
        if [s.get("dataset") for s in saved] != [s["dataset"] for s in mine]:
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

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._run()

    def _run(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        opts = self.options
        if self._legs_before and self._resumed_used:  # the epoch again: afresh, at this world size
            self._legs_before = ()
            self._next_start = 0
        self._resumed_used = True
        plan = self._plan()
        leg = len(plan.legs) - 1
        first = plan.batches_before(leg)
        share = plan.share(leg, opts.rank)
        start, self._next_start = self._next_start, 0
        self._consumed = start
        b = opts.batch_size
        done = share.taken((start - first) * b)
        cursors = [_Cursor(spans, n) for spans, n in zip(share.spans, done, strict=True)]
        self.source_rows = [0] * len(self._streams)
        self._began = [ld.totals() for ld in self._loaders]
        self._batches_run = 0
        for j in range(start - first, plan.num_batches(leg)):
            counts = np.bincount(share.order[j * b : (j + 1) * b], minlength=len(self._streams))
            parts = []
            for s, n in enumerate(counts.tolist()):
                if n:
                    parts += self._streams[s].take(cursors[s], n)
                    self.source_rows[s] += n
            self._consumed += 1
            self._batches_run += 1
            yield self._join(parts)

    def _join(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of the sources' rows, source after source: one copy of each part's pixels
        into a reused block (a block of pinned memory when the parts are pinned), single-threaded
        (``torch.cat`` spreads a copy over torch's intra-op threads, which then wait on the cores
        the decode threads use: half the mixture's throughput on 2 cores)."""
        if len(parts) == 1:
            return parts[0]
        images = [p[0] for p in parts]
        labels = torch.cat([p[1] for p in parts])
        nhwc = [x.permute(0, 2, 3, 1) for x in images]
        if images[0].dtype != torch.uint8 or not all(x.is_contiguous() for x in nhwc):
            return torch.cat(images), labels
        shape = (sum(len(x) for x in images), *nhwc[0].shape[1:])
        if images[0].is_pinned():
            out = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            block = out.numpy()
        else:
            block = self._buffers.take(shape)
            out = torch.from_numpy(block)
        np.concatenate([x.numpy() for x in nhwc], out=block)
        return out.permute(0, 3, 1, 2), labels

    def close(self) -> None:
        """Stop every source's threads (a later iteration makes new ones)."""
        for ld in self._loaders:
            ld.close()
        for s in getattr(self, "_streams", ()):
            s.reset()

    def as_dataset(self) -> ShardDataset:
        """This loader as a :class:`torch.utils.data.IterableDataset` (see :mod:`loaders.dataset`)."""
        return ShardDataset(self)  # type: ignore[arg-type]

    def epoch_stats(self) -> LoaderStats:
        """What the current (or last) iteration cost on this rank, over all sources (see
        :class:`~loaders.stats.LoaderStats`; ``batches`` are the mixture's, ``shuffle`` is not
        measured)."""
        moved = sum(
            (ld.totals() - b for ld, b in zip(self._loaders, self._began, strict=True)), LoaderTotals()
        )
        moved = dataclasses.replace(moved, batches=self._batches_run)
        return LoaderStats.of(
            moved,
            epoch=self._epoch,
            peak_bytes_held=sum(ld.peak_bytes_held for ld in self._loaders),
            prices=self.options.prices,
        )

    @property
    def source_loaders(self) -> list[ShardLoader]:
        """Each source's own loader (world size 1), in the order of the sources."""
        return list(self._loaders)

    @property
    def skipped_rows(self) -> list[Any]:
        """Bad rows the sources skipped in their current (or last) pass (``skip_bad_rows``)."""
        return [row for ld in self._loaders for row in ld.skipped_rows]

    def __enter__(self) -> MixedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _Cursor:
    """A rank's runs of one source's stream in one leg, and how many of their rows it has taken."""

    spans: tuple[Span, ...]
    taken: int

    def next_runs(self, n: int) -> list[Span]:
        """The stream positions of the next ``n`` rows (and takes them)."""
        out, skip = [], self.taken
        for a, b in self.spans:
            if skip >= b - a:
                skip -= b - a
                continue
            lo = a + skip
            hi = min(b, lo + n - sum(y - x for x, y in out))
            out.append((lo, hi))
            skip = 0
            if sum(y - x for x, y in out) == n:
                break
        got = sum(y - x for x, y in out)
        if got != n:
            raise LoaderError(f"mixture plan: {n} rows asked of a source with {got} left in this leg")
        self.taken += n
        return out


class _Stream:
    """One source read as its stream (:mod:`loaders.mixing`): passes of its world-size-1 loader
    one after another, entered at any position.

    ``_pos`` is the stream position of the next row of ``_held`` (the rest of the loader batch
    in hand), or of the iterator's next batch when ``_rows`` is empty; ``None``: no iterator.
    """

    def __init__(self, loader: ShardLoader, lut: torch.Tensor | None) -> None:
        self.loader = loader
        self.rows = loader.total_rows
        self.batch = loader.options.batch_size
        self._lut = lut
        self._it: Iterator[Any] | None = None
        self._pos: int | None = None
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        it, self._it, self._pos, self._held = self._it, None, None, None
        if it is not None:
            it.close()  # type: ignore[attr-defined]

    def take(self, cursor: _Cursor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for lo, hi in cursor.next_runs(n):
            while lo < hi:
                images, labels = self._at(lo)
                k = min(hi - lo, len(labels))
                out.append((images[:k], labels[:k]))
                self._advance(k)
                lo += k
        return out

    def _at(self, x: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows from stream position ``x`` on, to the end of a loader batch."""
        if self._pos != x:
            self._enter(x)
        if self._held is None:
            assert self._it is not None and self._pos is not None
            batch = next(self._it, None)
            if batch is None:  # the pass ended: the next one follows (the loader keeps its threads)
                self.loader.set_epoch(locate(self._pos, self.rows)[0])
                self._it = iter(self.loader)
                batch = next(self._it)
            self._held = self._relabel(batch)
        return self._held

    def _advance(self, k: int) -> None:
        images, labels = self._held  # type: ignore[misc]
        self._held = None if k == len(labels) else (images[k:], labels[k:])
        self._pos += k  # type: ignore[operator]

    def _enter(self, x: int) -> None:
        """Start the iterator at stream position ``x``: its pass from the loader batch holding it."""
        self.reset()
        p, offset = locate(x, self.rows)
        ld = self.loader
        k, skip = divmod(offset, self.batch)
        opts = ld.options
        ld.load_state_dict(
            state_dict(
                dataset=ld.dataset,
                dataset_version=ld.dataset_version,
                channel=opts.channel,
                epoch=p,
                legs=[Leg(1, self.batch, k)],
                order=opts.order_key(),
            )
        )
        ld.set_epoch(p)
        self._it = iter(ld)
        self._pos = x - skip
        if skip:
            self._at(self._pos)
            self._advance(skip)

    def _relabel(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise LoaderError(
                f"a mixture needs (images, labels) batches from each source; {self.loader.dataset} gave "
                f"{type(batch).__name__} (a transform must return (images, labels))"
            )
        images, labels = batch
        return images, _relabelled(labels, self._lut)


def _positive_int(samples_per_epoch: Any) -> int:
    """``samples_per_epoch`` as an int: a positive integer of Python's or numpy's."""
    if isinstance(samples_per_epoch, bool | np.bool_) or not isinstance(samples_per_epoch, numbers.Integral):
        raise ConfigError(f"samples_per_epoch must be a positive integer, got {samples_per_epoch!r}")
    if samples_per_epoch < 1:
        raise ConfigError(f"samples_per_epoch must be a positive integer, got {samples_per_epoch!r}")
    return operator.index(samples_per_epoch)


def _normalised(raw: list[float]) -> list[float]:
    """``raw`` weights scaled to sum to 1, scaled by the largest first (1e308 + 1e308 overflows)."""
    top = max(raw)
    scaled = [w / top for w in raw]
    return [w / sum(scaled) for w in scaled]


def _check_every_source_has_rows(
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


def _channel_rows(uri: str, channel: str) -> int:
    """Rows of ``channel`` in the dataset at ``uri`` (from its ``dataset.json``).

    Raises:
        DatasetError: no such channel, or no rows in it.
    """
    root = storage.normalize(uri)
    info = contract.read_dataset_info(root)
    rows = sum(n for _, n in contract.channel_shards(root, info, channel))
    if rows == 0:
        raise DatasetError(f"source {uri} has no rows in channel {channel!r}")
    return rows


def _same_size(loaders: list[ShardLoader], crop: int | None) -> int:
    """The image size every source yields; refuses sources of different sizes without ``crop``."""
    sizes = {ld.dataset: ld.image_size for ld in loaders}
    if crop is not None:
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


def _relabelled(labels: torch.Tensor, lut: torch.Tensor | None) -> torch.Tensor:
    if lut is None:
        return labels
    return torch.where(labels != PAD_LABEL, lut[labels.clamp(min=0)], labels)


class Concatenated:
    """Several loaders of one channel read one after another, their labels mapped into one label
    space (``labels``: name -> index): how a trainer evaluates on the validation channels of the
    datasets it mixes. Every rank yields as many batches as any other (each loader does)."""

    def __init__(self, loaders: Sequence[ShardLoader], labels: dict[str, int]) -> None:
        self.loaders = list(loaders)
        self._luts = [relabelling(ld.info.labels, labels) for ld in self.loaders]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for ld, lut in zip(self.loaders, self._luts, strict=True):
            for images, labels in ld:
                yield images, _relabelled(labels, lut)

    def __len__(self) -> int:
        return sum(len(ld) for ld in self.loaders)

    def close(self) -> None:
        for ld in self.loaders:
            ld.close()


def _label_space(loaders: list[ShardLoader], policy: str) -> tuple[dict[str, int], list[torch.Tensor | None]]:
    """One label space for all sources (name -> index) and, per source, the map from its label
    index to the space's (``None`` where they are the same)."""
    names = [ld.info.labels for ld in loaders]
    if policy == "same":
        for ld, theirs in zip(loaders[1:], names[1:], strict=True):
            if set(theirs) != set(names[0]):
                only_first = sorted(set(names[0]) - set(theirs))
                only_this = sorted(set(theirs) - set(names[0]))
                raise DatasetError(
                    f'labels="same": {ld.dataset} has other label names than {loaders[0].dataset} '
                    f"(only in {loaders[0].dataset}: {only_first or 'none'}; only in {ld.dataset}: "
                    f'{only_this or "none"}); pass labels="union" to train on all of them'
                )
    space = {name: i for i, name in enumerate(sorted({n for m in names for n in m}))}
    return space, [relabelling(mapping, space) for mapping in names]
