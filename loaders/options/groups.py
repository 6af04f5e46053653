"""The loader's options beyond the common ones, in four small frozen groups, each checked on
creation: :class:`RemoteReads`, :class:`Decoding`, :class:`Preparation` and :class:`Cost`.

Each field is an option of its own name (``RemoteReads(cache_dir=...)`` is ``cache_dir=...``
of ``ShardLoader``): its default, help and check are its :func:`~loaders.options.table.option`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lakeshard.errors import ConfigError
from lakeshard.storage import CLIENT_CONNECTIONS
from loaders._internal.prep import make_security, resolve_reference
from loaders.decode import NO_DECODER
from loaders.options import values
from loaders.options.read_plan import ReadPlan
from loaders.options.table import check_fields, option, run_check
from loaders.stats import BUDGET_ACTIONS, PriceTable, prices_for

__all__ = [
    "DEFAULT_READ_CONCURRENCY",
    "GROUPS",
    "Cost",
    "Decoding",
    "Normalize",
    "Preparation",
    "RemoteReads",
    "group_options",
]

#: Remote row-group reads in flight by default: enough to hide a round trip of tens of ms behind
#: the reads before it at tens of MB/s per connection (see docs/performance.md).
DEFAULT_READ_CONCURRENCY = 8

#: ``normalize``: ``(mean, std)``, 3 floats each.
Normalize = tuple[tuple[float, float, float], tuple[float, float, float]]


@dataclass(frozen=True, slots=True)
class RemoteReads:
    """How a remote dataset (``s3://``) is read: its ranged reads, their memory, the shard cache.
    Local shards are read on the reader thread whatever these say (``cache_dir`` included)."""

    read_concurrency: int = option(
        DEFAULT_READ_CONCURRENCY,
        help="remote row-group reads each rank keeps in flight, in the order the epoch needs them "
        f"(at most {CLIENT_CONNECTIONS}; the threads, footers read at once, parts of a first read and "
        "the read-ahead follow from it: loaders.options.ReadPlan)",
        check=values.read_concurrency,
    )
    memory_budget: int | str | None = option(
        None,
        help="bytes (or a size, 512MiB) for a rank's remote reads held plus its decoded batches, the "
        "shuffle window's encoded rows on top (default: read_concurrency row groups, one shuffle window "
        "and the decoded batches)",
        check=values.optional(values.size),
    )
    cache_dir: str | os.PathLike[str] | None = option(
        None,
        help="local folder caching remote shards (checked against dataset.json's sha256), shared by "
        "the ranks of a machine; one that cannot be written is used read-only "
        "(default: $LAKESHARD_CACHE_DIR, else no cache)",
        check=values.optional(values.local_folder),
        command="str | None",
    )
    cache_limit: int | str = option(
        "50GiB",
        help="size of the shard cache; least recently used shards are evicted beyond it",
        check=values.size,
    )
    plan: ReadPlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cache_dir is None and os.environ.get("LAKESHARD_CACHE_DIR"):
            object.__setattr__(self, "cache_dir", os.environ["LAKESHARD_CACHE_DIR"])
        check_fields(self)
        object.__setattr__(self, "plan", ReadPlan.of(self.read_concurrency))

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (``None``: the default budget)."""
        assert self.memory_budget is None or isinstance(self.memory_budget, int)  # parsed on creation
        return self.memory_budget

    @property
    def cache_limit_bytes(self) -> int:
        """``cache_limit`` in bytes."""
        assert isinstance(self.cache_limit, int)  # parsed on creation
        return self.cache_limit


@dataclass(frozen=True, slots=True)
class Decoding:
    """How a batch's images are decoded and transformed. ``transform``, or the built-in
    ``augment``/``crop``/``normalize`` (which stand for
    :func:`~loaders.transforms.default_transform`), not both."""

    decoder: str = option(
        "auto",
        help="auto (a batch's JPEGs at once with loaders._jpeg when built, then simplejpeg for JPEG "
        "when installed, Pillow otherwise), pillow or simplejpeg (image by image), or none: no "
        "decoding, each batch an EncodedBatch of the encoded images, to decode on the GPU",
        check=values.decoder_name,
    )
    transform: Callable[..., Any] | str | None = option(
        None,
        help="fn(images, labels, generator) run on each decoded batch on the decode threads, or "
        "package.module:name naming one; the loader yields what it returns (instead of augment, "
        "crop and normalize)",
        check=values.optional(values.transform),
        command="str | None",
    )
    collate: Callable[..., Any] | str | None = option(
        None,
        help="fn(images, batch) for a multi-label or boxes dataset: what the loader yields, made of "
        "the images and the loaders.Batch (after the transform), or package.module:name naming one; "
        "default: the Batch itself",
        check=values.optional(values.collate),
        command=False,
    )
    augment: bool = option(
        False, help="random horizontal flips, and a random crop with crop", check=values.flag
    )
    crop: int | None = option(
        None,
        help="output size in pixels: a random crop with augment, a centre crop without",
        check=values.optional(values.positive_int),
    )
    normalize: Normalize | None = option(
        None,
        help="(mean, std), 3 numbers each, one per RGB channel on the 0-1 scale: images become "
        "float32 (x/255 - mean) / std instead of uint8; every std positive",
        check=values.optional(values.normalize),
        command=False,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.transform is not None:
            self._check_transform()
        if isinstance(self.collate, str):  # 'pkg.module:name': imported now, to check it
            run_check(lambda _, ref: resolve_reference(ref, what="collate"), "collate", self.collate)

    def _check_transform(self) -> None:
        if isinstance(self.transform, str):  # 'pkg.module:name': imported now, to check it
            run_check(lambda _, ref: resolve_reference(ref), "transform", self.transform)
        builtin = {
            k: v
            for k, v in (("augment", self.augment), ("crop", self.crop), ("normalize", self.normalize))
            if v
        }
        if builtin:
            raise ConfigError(
                f"pass either transform= or the built-in {', '.join(builtin)} option(s), not both (got transform="
                f"{self.transform!r} and {builtin}); put loaders.transforms.RandomFlipCrop/CenterCrop/Normalize in a Compose",
                option="transform",
            )

    @property
    def encoded(self) -> bool:
        """``decoder="none"``: batches of encoded images."""
        return self.decoder == NO_DECODER


@dataclass(frozen=True, slots=True)
class Preparation:
    """A preparation cluster (dask.distributed) that decodes and transforms each batch on its
    workers instead of the loader's threads, with the same pixels (:mod:`loaders._internal.prep`);
    ``num_threads`` batches are then in flight. A ``transform`` goes by reference: a
    module-level function, or ``"pkg.module:name"``. The cluster is trusted as this process's
    own code (docs/clusters.md)."""

    prep: str | None = option(
        None,
        help="a dask.distributed scheduler (tcp://host:8786) whose workers decode and transform the "
        "batches instead of this process's threads, with the same pixels (docs/loader.md, A preparation cluster)",
        check=values.optional(values.scheduler),
    )
    prep_timeout: float = option(
        60.0,
        help="with prep: seconds a batch may take on the cluster (and connecting may take) before the "
        "cluster counts as gone",
        check=values.positive("seconds"),
    )
    prep_fallback: bool = option(
        False,
        help="with prep: decode locally once the cluster is gone, instead of failing",
        check=values.flag,
    )
    prep_security: Any = option(
        None,
        help="with prep=tls://host:port: TLS to the cluster, a distributed.security.Security or "
        '{"ca_file": ..., "cert": ..., "key": ...} (PEM files: the CA, this client\'s certificate and key)',
        command=False,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.prep_security is not None:
            if not isinstance(self.prep, str) or not self.prep.startswith("tls://"):
                raise ConfigError(
                    f"prep_security is TLS to a preparation cluster: it needs prep='tls://host:port', got prep={self.prep!r}",
                    option="prep_security",
                )
            run_check(lambda _, value: make_security(value), "prep_security", self.prep_security)


@dataclass(frozen=True, slots=True)
class Cost:
    """What an epoch's reads cost (``epoch_stats().cost_usd``) and a budget for it, on this rank:
    when an epoch's estimate (its cost so far, scaled to all its batches) passes ``cost_budget``,
    ``on_budget`` says what happens."""

    prices: PriceTable | None = option(
        None,
        help="a loaders.stats.PriceTable pricing each epoch's requests and bytes "
        "(default: the dataset's store's, loaders.stats.STORE_PRICES: S3 or GCS Standard reads, "
        "transfer out of the region)",
        check=values.price_table,
        command=False,
    )
    cost_budget: float | None = option(
        None,
        help="US dollars an epoch's reads on this rank may cost; past it, on_budget",
        check=values.optional(values.dollars),
    )
    on_budget: str = option(
        "warn",
        help="what an epoch estimated over cost_budget does: warn (one WARNING an epoch) or stop (an error)",
        check=values.one_of(BUDGET_ACTIONS),
        choices=BUDGET_ACTIONS,
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def price_table(self, dataset: str) -> PriceTable:
        """``prices``, or where it was left ``None`` the default of ``dataset``'s store
        (:func:`loaders.stats.prices_for`)."""
        return self.prices if self.prices is not None else prices_for(dataset)


#: The groups, by the :class:`~loaders.options.LoaderOptions` field that holds each.
GROUPS: dict[str, type[RemoteReads | Decoding | Preparation | Cost]] = {
    "reads": RemoteReads,
    "decoding": Decoding,
    "preparation": Preparation,
    "cost": Cost,
}


def group_options(cls: type[RemoteReads | Decoding | Preparation | Cost]) -> tuple[str, ...]:
    """The options of group ``cls``."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)
