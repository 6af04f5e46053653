"""How one option's value is checked, alone: each function is ``check(name, value)``, returns
the value as kept and raises a :class:`ConfigError` naming the option and the value
(:data:`loaders.options.table.Check`). What needs two options is checked by their group."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lakeshard.errors import ConfigError
from lakeshard.settings import check_positive, check_seed, parse_size
from lakeshard.storage import CLIENT_CONNECTIONS
from loaders.decode import NO_DECODER, get_decoder
from loaders.stats import PriceTable
from loaders.transforms import check_mean_std

__all__ = [
    "collate",
    "decoder_name",
    "dollars",
    "flag",
    "listed",
    "local_folder",
    "normalize",
    "one_of",
    "optional",
    "positive",
    "positive_int",
    "price_table",
    "read_concurrency",
    "scheduler",
    "seed",
    "size",
    "transform",
]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``check``, with ``None`` let through (the option's "not set")."""

    def checked(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)

    return checked


def positive_int(name: str, value: Any) -> int:
    check_positive(name, value, error=ConfigError)
    return int(value)


def seed(name: str, value: Any) -> int:
    """The one seed rule, the jobs' and the trainer's: an ``int`` in ``[0, 2**32 - 1]``."""
    return check_seed(name, value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}", option=name)
    return value


def one_of(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    """One of ``choices``, named as the tuple they are (``('pad', 'drop')``)."""

    def checked(name: str, value: Any) -> str:
        if value not in choices:
            raise ConfigError(f"{name} must be one of {choices}, got {value!r}", option=name)
        return str(value)

    return checked


def listed(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    """One of ``choices``, listed as words (``train, validation, test``)."""

    def checked(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}", option=name)
        return value

    return checked


def size(name: str, value: Any) -> int:
    """Bytes: an ``int``, or a size such as ``"512MiB"``."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}", option=name) from None


def local_folder(name: str, value: Any) -> str:
    """A local folder's path (a :class:`os.PathLike` as its ``str``)."""
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ConfigError(f"{name} must be a local folder, got {value!r}", option=name)
    return os.fspath(value)


def read_concurrency(name: str, value: Any) -> int:
    """A positive integer, at most :data:`~lakeshard.storage.CLIENT_CONNECTIONS` (each read in
    flight holds a connection of the process's S3 client)."""
    positive_int(name, value)
    if value > CLIENT_CONNECTIONS:
        raise ConfigError(
            f"{name} must be at most {CLIENT_CONNECTIONS} (the connections of the process's S3 client, "
            f"one a read in flight), got {value!r}",
            option=name,
        )
    return int(value)


def decoder_name(name: str, value: Any) -> str:
    """A decoder of :mod:`loaders.decode`, or ``"none"`` (the encoded bytes)."""
    if value == NO_DECODER:
        return NO_DECODER
    try:
        get_decoder(value)
    except ValueError as exc:
        raise ConfigError(f"{exc} (or {NO_DECODER!r}: the encoded bytes)", option=name) from None
    return str(value)


def transform(name: str, value: Any) -> Any:
    """A callable, or ``"pkg.module:name"`` (imported by its group, :class:`~loaders.options.Decoding`)."""
    if not isinstance(value, str) and not callable(value):
        raise ConfigError(
            f"{name} must be a callable fn(images, labels, generator) or 'pkg.module:name', got {value!r}",
            option=name,
        )
    return value


def collate(name: str, value: Any) -> Any:
    """A callable, or ``"pkg.module:name"`` (imported by its group, :class:`~loaders.options.Decoding`)."""
    if not isinstance(value, str) and not callable(value):
        raise ConfigError(
            f"{name} must be a callable fn(images, batch) or 'pkg.module:name', got {value!r}", option=name
        )
    return value


def normalize(name: str, value: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)``, 3 numbers each, kept as ``((3 floats), (3 floats))`` (lists, as a YAML
    file gives them, included)."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ConfigError(
            f"{name} must be (mean, std), 3 numbers each (one per RGB channel), e.g. "
            f"((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), got {value!r}",
            option=name,
        )
    return check_mean_std(*value, what=name, where=f" ({name}={value!r})")


def scheduler(name: str, value: Any) -> str:
    """A dask scheduler's address, ``tcp://host:8786`` or ``tls://host:8786``."""
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(
            f"{name} must be a dask scheduler address such as 'tcp://host:8786', got {value!r}", option=name
        )
    return value


def positive(unit: str) -> Callable[[str, Any], float]:
    """A positive number of ``unit`` (``"seconds"``), finite or not."""

    def checked(name: str, value: Any) -> float:
        if not _is_number(value) or not value > 0:
            raise ConfigError(f"{name} must be a positive number of {unit}, got {value!r}", option=name)
        return value  # a number, as given (an int stays an int)

    return checked


dollars = positive("US dollars")


def price_table(name: str, value: Any) -> PriceTable | None:
    """A :class:`~loaders.stats.PriceTable`; ``None``: the default prices of the dataset's store."""
    if value is None:
        return None
    if not isinstance(value, PriceTable):
        raise ConfigError(f"{name} must be a loaders.stats.PriceTable, got {value!r}", option=name)
    return value
