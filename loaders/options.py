"""Every option of :class:`~loaders.ShardLoader`, in one frozen dataclass, checked on creation."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lakeshard.errors import ConfigError
from lakeshard.format import CHANNELS
from lakeshard.settings import check_positive, parse_size
from loaders.decode import NO_DECODER, get_decoder
from loaders.plan import RANK_REMAINDER_POLICIES
from loaders.prep import make_security, resolve_reference
from loaders.stats import BUDGET_ACTIONS, PriceTable
from loaders.transforms import check_mean_std

__all__ = ["DEFAULT_READ_CONCURRENCY", "ORDER_KEYS", "LoaderOptions", "default_threads", "option_default"]

#: Remote row-group reads in flight by default: enough to hide a round trip of tens of ms behind
#: the reads before it at tens of MB/s per connection (see docs/performance.md).
DEFAULT_READ_CONCURRENCY = 8

#: The options that are True or False.
_FLAGS = ("shuffle", "drop_last", "augment", "pin_memory", "skip_bad_rows", "prep_fallback")

#: The options that decide which batches come out (and so must match on resume).
ORDER_KEYS = ("world_size", "batch_size", "shuffle", "seed", "drop_last", "remainder", "shuffle_window")


def option_default(name: str) -> Any:
    """The library's default of loader option ``name``: what the trainer's and the doctor's flags
    default to, so that a command and the library never drift apart."""
    return {f.name: f.default for f in dataclasses.fields(LoaderOptions)}[name]


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
    """Every option of :class:`~loaders.ShardLoader`, which takes them as keywords.

    Attributes:
        channel: ``train``, ``validation`` or ``test``.
        rank, world_size: this process's place in the data-parallel group.
        batch_size: rows per batch on this rank (the per-rank batch, not the global one).
        shuffle: permute row groups and rows (within a window of ``shuffle_window`` rows), seeded
            by ``(seed, epoch, rank)``; off, rows come in shard order.
        seed: the seed of the shuffle and of augmentation.
        drop_last: drop the short last batch of each epoch (it is the same size on every rank).
        remainder: ``"pad"`` (every row is read; fewer than ``world_size`` rows are repeated and
            labelled :data:`~loaders.PAD_LABEL`) or ``"drop"`` (up to ``world_size - 1`` rows
            unread); see :mod:`loaders.plan`.
        shuffle_window: rows shuffled together; also the reader's memory bound (encoded rows).
        num_threads: decode threads; default :func:`default_threads` (one per core this rank
            gets: decode threads never wait on I/O, the reader thread does; a fixed default
            would starve a larger machine).
        prefetch: batches decoded ahead of the training loop.
        decoder: ``"auto"`` (each batch's JPEGs at once with ``loaders._jpeg`` when built; then
            simplejpeg for JPEG when installed, Pillow otherwise), ``"pillow"`` or
            ``"simplejpeg"`` (image by image); see ``loaders/decode.py``. ``"none"``: no
            decoding; each batch is an :class:`~loaders.EncodedBatch` of the encoded images (to
            decode on the GPU), with the same rows, order and state as a decoding loader
            (``augment``, ``crop``, ``normalize``, ``transform`` and ``pin_memory`` must be unset).
        augment: random horizontal flip, and a random crop when ``crop`` is set.
        crop: output size; a random crop with ``augment``, a centre crop without.
        normalize: ``(mean, std)``, 3 numbers each (one per RGB channel, on the 0-1 scale; lists
            are taken as tuples of floats): images become float32 ``(x/255 - mean) / std``
            instead of uint8; every std must be positive.
        pin_memory: pin batches for fast host-to-GPU copies (only when CUDA is available).
        read_concurrency: reads of a remote shard's row groups in flight at once, on the loader's
            fetch threads, in the order the epoch needs them; default :data:`DEFAULT_READ_CONCURRENCY`.
            Local shards are read on the reader thread (the fastest way for a local disk).
        memory_budget: bytes (``int`` or a size such as ``"512MiB"``) for the remote reads in
            flight or waiting plus the decoded batches (``(num_threads + prefetch + 3)`` blocks of
            one batch); default: exactly the decoded batches, ``read_concurrency`` row groups and
            one shuffle window of encoded rows (so the next window is read while one is decoded).
            Too small for one row group is a :class:`ConfigError`. The window of encoded rows the
            reader shuffles (``shuffle_window`` rows) comes on top.
        cache_dir: a local folder for remote shards (``None``: ``LAKESHARD_CACHE_DIR``, or no
            cache): each shard this rank reads is kept there, checked against ``dataset.json``'s
            sha256, so later epochs (and runs) read nothing remotely; a folder that cannot be
            written is used read-only (its shards read from it, the others remotely, one
            WARNING); see :mod:`loaders.cache`.
        cache_limit: the cache's size (``"50GiB"``); least recently used shards go first.
        skip_bad_rows: a row that cannot be decoded (or has a label out of range) becomes an
            all-zero image labelled :data:`~loaders.PAD_LABEL`, is logged and counted in
            ``ShardLoader.skipped_rows``, instead of raising :class:`LoaderError`. Read errors (a
            shard that cannot be read) always raise.
        transform: ``fn(images, labels, generator)`` (or ``"pkg.module:name"`` naming one) run on each decoded batch on the decode
            threads (see :mod:`loaders.transforms`); the loader yields what it returns. Without
            it, ``augment``, ``crop`` and ``normalize`` stand for
            :func:`~loaders.transforms.default_transform`; with it, they must be left unset.
        prep: a dask.distributed scheduler (``"tcp://host:8786"``): each batch is decoded and
            transformed on the cluster's workers instead of this loader's threads, with the same
            pixels; ``num_threads`` batches are in flight (see :mod:`loaders.prep`). A
            ``transform`` then goes by reference: a module-level function, or ``"pkg.module:name"``.
        prep_timeout: seconds a batch may take on the cluster (and connecting may take) before
            the cluster counts as gone: :class:`LoaderError`, or with ``prep_fallback`` the loader
            decodes on its own threads from then on.
        prep_fallback: decode locally when the preparation cluster is gone, instead of failing.
        prep_security: TLS to the preparation cluster (``prep="tls://host:8786"``): a
            ``distributed.security.Security``, or ``{"ca_file": ..., "cert": ..., "key": ...}``
            (PEM files: the CA the cluster's certificates are signed by, this client's certificate
            and key). The cluster is trusted as this process's own code (docs/clusters.md).
        prices: a :class:`~loaders.stats.PriceTable` to price each epoch's requests and bytes
            (``epoch_stats().cost_usd``); default: S3 Standard GETs, transfer out of the region.
        cost_budget: US dollars an epoch's reads (on this rank) may cost; when an epoch's
            estimate (its cost so far, scaled to all its batches) passes it, ``on_budget``:
            ``"warn"`` (one WARNING an epoch) or ``"stop"`` (:class:`LoaderError`).
    """

    channel: str = "train"
    rank: int = 0
    world_size: int = 1
    batch_size: int = 64
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    remainder: str = "pad"
    shuffle_window: int = 2048
    num_threads: int | None = None  # None: default_threads()
    prefetch: int = 4
    decoder: str = "auto"
    augment: bool = False
    crop: int | None = None
    normalize: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    pin_memory: bool = False
    skip_bad_rows: bool = False
    transform: Callable[..., Any] | str | None = None
    read_concurrency: int = 8  # DEFAULT_READ_CONCURRENCY
    memory_budget: int | str | None = None
    cache_dir: str | None = None
    cache_limit: int | str = "50GiB"
    prep: str | None = None
    prep_timeout: float = 60.0
    prep_fallback: bool = False
    prep_security: Any = None  # a distributed.security.Security or the paths of its files
    prices: PriceTable | None = None
    cost_budget: float | None = None
    on_budget: str = "warn"

    @classmethod
    def from_keywords(cls, options: dict[str, Any]) -> LoaderOptions:
        """``LoaderOptions(**options)``, with a :class:`ConfigError` naming an unknown option."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown loader option(s) {unknown}; the options are {sorted(known)}")
        return cls(**options)

    def __post_init__(self) -> None:
        if self.num_threads is None:
            object.__setattr__(self, "num_threads", default_threads())
        if self.cache_dir is None and os.environ.get("LAKESHARD_CACHE_DIR"):
            object.__setattr__(self, "cache_dir", os.environ["LAKESHARD_CACHE_DIR"])
        for name in ("memory_budget", "cache_limit"):
            value = getattr(self, name)
            if value is not None or name == "cache_limit":
                try:
                    object.__setattr__(self, name, parse_size(value))
                except ValueError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if self.cache_dir is not None and (
            not isinstance(self.cache_dir, str | os.PathLike) or not str(self.cache_dir)
        ):
            raise ConfigError(f"cache_dir must be a local folder, got {self.cache_dir!r}")
        for name in (
            "batch_size",
            "world_size",
            "shuffle_window",
            "num_threads",
            "prefetch",
            "read_concurrency",
        ):
            check_positive(name, getattr(self, name), error=ConfigError)
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank must be an integer in [0, world_size={self.world_size}), got {self.rank!r}"
            )
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.remainder not in RANK_REMAINDER_POLICIES:
            raise ConfigError(f"remainder must be one of {RANK_REMAINDER_POLICIES}, got {self.remainder!r}")
        if self.channel not in CHANNELS:
            raise ConfigError(f"channel must be one of {CHANNELS}, got {self.channel!r}")
        if self.decoder == NO_DECODER:
            self._check_encoded()
        else:
            try:
                get_decoder(self.decoder)
            except ValueError as exc:
                raise ConfigError(f"{exc} (or {NO_DECODER!r}: the encoded bytes)") from None
        check_positive("crop", self.crop, allow_none=True, error=ConfigError)
        if self.normalize is not None:
            self._check_normalize()
        if self.transform is not None:
            self._check_transform()
        if self.prep is not None and (not isinstance(self.prep, str) or "://" not in self.prep):
            raise ConfigError(
                f"prep must be a dask scheduler address such as 'tcp://host:8786', got {self.prep!r}"
            )
        timeout = self.prep_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ConfigError(f"prep_timeout must be a positive number of seconds, got {timeout!r}")
        if self.prep_security is not None:
            if not isinstance(self.prep, str) or not self.prep.startswith("tls://"):
                raise ConfigError(
                    f"prep_security is TLS to a preparation cluster: it needs prep='tls://host:port', got prep={self.prep!r}"
                )
            make_security(self.prep_security)
        if self.prep is not None and self.decoder == NO_DECODER:
            raise ConfigError(f"prep= decodes on a cluster; decoder={NO_DECODER!r} decodes nothing: pick one")
        if self.prices is None:
            object.__setattr__(self, "prices", PriceTable())
        elif not isinstance(self.prices, PriceTable):
            raise ConfigError(f"prices must be a loaders.stats.PriceTable, got {self.prices!r}")
        budget = self.cost_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0
        ):
            raise ConfigError(f"cost_budget must be a positive number of US dollars, got {budget!r}")
        if self.on_budget not in BUDGET_ACTIONS:
            raise ConfigError(f"on_budget must be one of {BUDGET_ACTIONS}, got {self.on_budget!r}")

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
                f"(got {pixels}); decode and transform on the GPU instead (docs/loader.md, GPU decoding)"
            )

    def _check_transform(self) -> None:
        if isinstance(self.transform, str):
            resolve_reference(self.transform)  # 'pkg.module:name': imported now, to check it
        elif not callable(self.transform):
            raise ConfigError(
                f"transform must be a callable fn(images, labels, generator) or 'pkg.module:name', got {self.transform!r}"
            )
        builtin = {
            k: v
            for k, v in (("augment", self.augment), ("crop", self.crop), ("normalize", self.normalize))
            if v
        }
        if builtin:
            raise ConfigError(
                f"pass either transform= or the built-in {', '.join(builtin)} option(s), not both (got transform="
                f"{self.transform!r} and {builtin}); put loaders.transforms.RandomFlipCrop/CenterCrop/Normalize in a Compose"
            )

    def _check_normalize(self) -> None:
        """Check ``normalize`` and keep it as ``((3 floats), (3 floats))``."""
        value = self.normalize
        if not isinstance(value, tuple | list) or len(value) != 2:
            raise ConfigError(
                f"normalize must be (mean, std), 3 numbers each (one per RGB channel), e.g. "
                f"((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), got {value!r}"
            )
        mean, std = check_mean_std(*value, what="normalize", where=f" (normalize={value!r})")
        object.__setattr__(self, "normalize", (mean, std))

    # The options as __post_init__ resolved them (a default chosen, a size parsed), typed as such:
    # what the loader reads.
    @property
    def decode_threads(self) -> int:
        """``num_threads``, or :func:`default_threads` where it was left ``None``."""
        assert isinstance(self.num_threads, int)  # set by __post_init__
        return self.num_threads

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (``None``: the default budget)."""
        assert self.memory_budget is None or isinstance(self.memory_budget, int)  # parsed by __post_init__
        return self.memory_budget

    @property
    def cache_limit_bytes(self) -> int:
        """``cache_limit`` in bytes."""
        assert isinstance(self.cache_limit, int)  # parsed by __post_init__
        return self.cache_limit

    @property
    def price_table(self) -> PriceTable:
        """``prices``, or the default :class:`PriceTable` where it was left ``None``."""
        assert self.prices is not None  # set by __post_init__
        return self.prices

    def order_key(self) -> dict[str, Any]:
        """The options that decide which batches come out (and so must match on resume)."""
        return {k: getattr(self, k) for k in ORDER_KEYS}


def _is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
