""":class:`LoaderOptions`: every option of the loaders, checked on creation, and the options table
(:data:`OPTIONS`) that the loaders' keywords and the commands' flags come from."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lakeshard.errors import ConfigError
from lakeshard.format import CHANNELS
from loaders._internal.plan import RANK_REMAINDER_POLICIES
from loaders.decode import NO_DECODER
from loaders.options import values
from loaders.options.groups import GROUPS, Cost, Decoding, Normalize, Preparation, RemoteReads
from loaders.options.read_plan import ReadPlan
from loaders.options.table import DEFAULT, Option, check_fields, option, rows
from loaders.stats import PriceTable

__all__ = ["KEYWORDS", "OPTIONS", "ORDER_KEYS", "LoaderOptions", "default_threads", "option_default"]

#: The options that decide which batches come out (and so must match on resume).
ORDER_KEYS = ("world_size", "batch_size", "shuffle", "seed", "drop_last", "remainder", "shuffle_window")


def default_threads(local_world_size: int | None = None) -> int:
    """Decode threads when none are given: the CPUs this process may run on (its affinity mask,
    which container limits and ``taskset`` narrow), shared among the ranks on this machine
    (``local_world_size``, by default ``LOCAL_WORLD_SIZE``, which ``torchrun`` sets); at least 1.
    The trainer gives torch's intra-op threads the same share."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    if local_world_size is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
        try:
            local_world_size = int(raw)
        except ValueError:
            local_world_size = 0
        if local_world_size < 1:
            raise ConfigError(
                f"LOCAL_WORLD_SIZE must be a positive integer, got {raw!r} (from the environment)"
            )
    return max(1, cpus // max(1, local_world_size))


@dataclass(frozen=True, slots=True)
class LoaderOptions:
    """Every option of :class:`~loaders.ShardLoader` and :class:`~loaders.MixedLoader`: the
    common ones as fields of their own, the others in four groups (:mod:`loaders.options.groups`):
    ``reads`` (:class:`RemoteReads`), ``decoding`` (:class:`Decoding`), ``preparation``
    (:class:`Preparation`) and ``cost`` (:class:`Cost`). What each option does is its help in
    :data:`OPTIONS` (docs/loader.md lists them all).

    Every option is also an attribute of its own name (``opts.cache_dir`` is
    ``opts.reads.cache_dir``), as it is a keyword of its own name of the loaders. Made with the
    groups (``LoaderOptions(batch_size=32, reads=RemoteReads(cache_dir="/cache"))``) or with
    every option a keyword (:meth:`from_keywords`); checked on creation, each group by itself and
    then what spans them, a bad value a :class:`ConfigError` whose ``option`` names it.
    """

    channel: str = option(
        "train", help="the channel to read: train, validation or test", check=values.listed(CHANNELS)
    )
    rank: int = option(0, help="this process's rank in the data-parallel group, in [0, world_size)")
    world_size: int = option(
        1,
        help="ranks in the data-parallel group, each reading its share of the rows",
        check=values.positive_int,
    )
    batch_size: int = option(
        64,
        help="rows per batch on this rank (the per-rank batch, not the global one)",
        check=values.positive_int,
    )
    shuffle: bool = option(
        False,
        help="permute the row groups, then the rows within each window of shuffle_window rows, seeded by "
        "(seed, epoch, rank); off: shard order",
        check=values.flag,
    )
    seed: int = option(
        0, help="the seed of the shuffle and of augmentation, in [0, 2**32 - 1]", check=values.seed
    )
    drop_last: bool = option(
        False,
        help="drop each epoch's short last batch (it is the same size on every rank)",
        check=values.flag,
    )
    remainder: str = option(
        "pad",
        help="rows that do not divide by world_size: pad (every row is read, fewer than world_size rows "
        "repeated and labelled PAD_LABEL) or drop (up to world_size - 1 rows unread)",
        check=values.one_of(RANK_REMAINDER_POLICIES),
        choices=RANK_REMAINDER_POLICIES,
    )
    shuffle_window: int = option(
        2048,
        help="rows shuffled together; also the reader's memory bound (encoded rows)",
        check=values.positive_int,
    )
    num_threads: int | None = option(
        None,
        help="decode threads (default: the cores this process may use, shared by the ranks of its machine: "
        "decode threads never wait on I/O, the reader thread does)",
        check=values.optional(values.positive_int),
    )
    prefetch: int = option(4, help="batches decoded ahead of the training loop", check=values.positive_int)
    pin_memory: bool = option(
        False, help="pin batches for fast host-to-GPU copies (ignored without CUDA)", check=values.flag
    )
    skip_bad_rows: bool = option(
        False,
        help="a row that cannot be decoded (or whose label is out of range) becomes ignored padding, "
        "logged and counted, instead of an error; a shard that cannot be read always fails",
        check=values.flag,
    )
    reads: RemoteReads = field(default_factory=RemoteReads)
    decoding: Decoding = field(default_factory=Decoding)
    preparation: Preparation = field(default_factory=Preparation)
    cost: Cost = field(default_factory=Cost)

    def __post_init__(self) -> None:
        if self.num_threads is None:
            object.__setattr__(self, "num_threads", default_threads())
        check_fields(self)
        if (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int)
            or not 0 <= self.rank < self.world_size
        ):
            raise ConfigError(
                f"rank must be an integer in [0, world_size={self.world_size}), got {self.rank!r}",
                option="rank",
            )
        for name, kind in GROUPS.items():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    f"{name} must be a loaders.options.{kind.__name__}, got {getattr(self, name)!r}",
                    option=name,
                )
        if self.decoding.encoded:
            self._check_encoded()
            if self.prep is not None:
                raise ConfigError(
                    f"prep= decodes on a cluster; decoder={NO_DECODER!r} decodes nothing: pick one",
                    option="prep",
                )

    def _check_encoded(self) -> None:
        """``decoder="none"`` yields encoded bytes: nothing that works on pixels may be set."""
        pixels = {
            k: v
            for k, v in (
                ("augment", self.augment),
                ("crop", self.crop),
                ("normalize", self.normalize),
                ("transform", self.transform),
                ("pin_memory", self.pin_memory),
            )
            if v
        }
        if pixels:
            raise ConfigError(
                f"decoder={NO_DECODER!r} yields the encoded images, so {', '.join(pixels)} cannot apply "
                f"(got {pixels}); decode and transform on the GPU instead (docs/loader.md, GPU decoding)",
                option="decoder",
            )

    # -- made from keywords ----------------------------------------------------------------------
    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> LoaderOptions:
        """The options given as keywords: each option by its name (``cache_dir=...``), a group by
        its field (``reads=RemoteReads(...)``, ``None``: not given).

        Raises:
            ConfigError: an unknown keyword; an option given both by itself and in its group
                (``option`` names it); a bad value.
        """
        unknown = sorted(set(keywords) - set(KEYWORDS))
        if unknown:
            raise ConfigError(f"unknown loader option(s) {unknown}; the options are {sorted(KEYWORDS)}")
        groups: dict[str, Any] = {}
        for group, kind in GROUPS.items():
            flat = {k: v for k, v in keywords.items() if k in OPTIONS and OPTIONS[k].group == group}
            given = keywords.get(group)
            if given is None:
                groups[group] = kind(**flat)
                continue
            if flat:
                name = next(iter(flat))
                raise ConfigError(
                    f"{name} is an option of {group}=: give it in {group}={kind.__name__}(...) or as "
                    f"{name}= with {group}= left out, not both (got {name}={flat[name]!r} and {group}={given!r})",
                    option=name,
                )
            groups[group] = given
        common = {k: v for k, v in keywords.items() if k in OPTIONS and OPTIONS[k].group is None}
        return cls(**common, **groups)

    @classmethod
    def given(cls, options: LoaderOptions | None, keywords: Mapping[str, Any]) -> LoaderOptions:
        """The options of a loader's call: ``options``, or else those of ``keywords``, the call's
        parameters (its ``locals()``), of which those left :data:`DEFAULT` (a group: ``None``)
        were not given.

        Raises:
            ConfigError: ``options`` and keywords both; see :meth:`from_keywords`.
        """
        given = {
            k: v
            for k, v in keywords.items()
            if k in KEYWORDS and v is not DEFAULT and not (k in GROUPS and v is None)
        }
        if options is None:
            return cls.from_keywords(given)
        if given:
            raise ConfigError(
                f"pass the loader options either as options= or as keywords, not both (got {sorted(given)})"
            )
        if not isinstance(options, LoaderOptions):
            raise ConfigError(f"options must be a loaders.LoaderOptions, got {options!r}", option="options")
        return options

    def keywords(self) -> dict[str, Any]:
        """Every option by its name, as checked (:meth:`from_keywords` of them is these options)."""
        return {name: getattr(self, name) for name in OPTIONS}

    def replace(self, **changes: Any) -> LoaderOptions:
        """These options with ``changes`` (options by their names), checked again."""
        return LoaderOptions.from_keywords({**self.keywords(), **changes})

    def order_key(self) -> dict[str, Any]:
        """The options that decide which batches come out (and so must match on resume)."""
        return {k: getattr(self, k) for k in ORDER_KEYS}

    # -- the groups' options by their own names --------------------------------------------------
    @property
    def read_concurrency(self) -> int:
        return self.reads.read_concurrency

    @property
    def memory_budget(self) -> int | str | None:
        return self.reads.memory_budget

    @property
    def cache_dir(self) -> str | None:
        return None if self.reads.cache_dir is None else os.fspath(self.reads.cache_dir)

    @property
    def cache_limit(self) -> int | str:
        return self.reads.cache_limit

    @property
    def decoder(self) -> str:
        return self.decoding.decoder

    @property
    def transform(self) -> Callable[..., Any] | str | None:
        return self.decoding.transform

    @property
    def collate(self) -> Callable[..., Any] | str | None:
        return self.decoding.collate

    @property
    def augment(self) -> bool:
        return self.decoding.augment

    @property
    def crop(self) -> int | None:
        return self.decoding.crop

    @property
    def normalize(self) -> Normalize | None:
        return self.decoding.normalize

    @property
    def prep(self) -> str | None:
        return self.preparation.prep

    @property
    def prep_timeout(self) -> float:
        return self.preparation.prep_timeout

    @property
    def prep_fallback(self) -> bool:
        return self.preparation.prep_fallback

    @property
    def prep_security(self) -> Any:
        return self.preparation.prep_security

    @property
    def prices(self) -> PriceTable | None:
        return self.cost.prices

    @property
    def cost_budget(self) -> float | None:
        return self.cost.cost_budget

    @property
    def on_budget(self) -> str:
        return self.cost.on_budget

    # -- resolved on creation (a default chosen, a size parsed), typed as such: what the loader reads
    @property
    def decode_threads(self) -> int:
        """``num_threads``, or :func:`default_threads` where it was left ``None``."""
        assert isinstance(self.num_threads, int)  # set by __post_init__
        return self.num_threads

    @property
    def read_plan(self) -> ReadPlan:
        """What ``read_concurrency`` sets: the reads in flight, the threads, ... (:class:`ReadPlan`)."""
        return self.reads.plan

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (``None``: the default budget)."""
        return self.reads.memory_budget_bytes

    @property
    def cache_limit_bytes(self) -> int:
        """``cache_limit`` in bytes."""
        return self.reads.cache_limit_bytes

    def price_table(self, dataset: str) -> PriceTable:
        """``prices``, or where it was left ``None`` the default of ``dataset``'s store."""
        return self.cost.price_table(dataset)


#: The options table: every option by name, the common ones first, then each group's.
OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        *rows(LoaderOptions, None),
        *(o for group, kind in GROUPS.items() for o in rows(kind, group)),
    )
}

#: The keywords of the loaders: every option, and each group.
KEYWORDS: tuple[str, ...] = (*OPTIONS, *GROUPS)


def option_default(name: str) -> Any:
    """The library's default of loader option ``name``."""
    return OPTIONS[name].default
