"""Job configuration: one commented YAML file per job in ``conf/``, loaded into a frozen
dataclass, every key overridable from the command line.

The dataclass is the single source of truth: each field's ``metadata`` holds its help text
and parser, :func:`add_arguments` builds the argparse options from it, and :func:`resolve`
layers defaults < YAML file < command line, naming the option as the user types it
(``--num-shards``) and where its value came from (``command line``, ``--conf FILE`` or
``default``) in every error: the parsers' errors and the dataclass's own checks alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from lakeshard.errors import ConfigError
from lakeshard.format.layout import CHANNELS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "MAX_SEED",
    "add_arguments",
    "check_fraction",
    "check_positive",
    "opt",
    "parse_globs",
    "parse_seed",
    "parse_size",
    "parse_split",
    "read_yaml",
    "resolve",
]

#: Seeds are 32-bit (what numpy's and torch's generators take everywhere).
MAX_SEED = 2**32 - 1

T = TypeVar("T", bound="DataclassInstance")  # resolve() builds a dataclass

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: str | int) -> int:
    """``"128MiB"`` -> 134217728; ``"4MB"`` -> 4000000; an int is taken as bytes."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be a number of bytes or a string like '4MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value!r}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"a size must look like '4MiB', '512KB' or '1000', got {value!r}")
    size = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if _SIZE_UNITS[m.group(2).lower()] == 1 and not size.is_integer():
        raise ValueError(
            f"a size in bytes must be a whole number (or carry a unit, like '1.5MiB'), got {value!r}"
        )
    return int(size)


def parse_split(value: str | Mapping[str, Any]) -> dict[str, float]:
    """``"train=0.8,validation=0.1,test=0.1"`` (or a mapping) -> ``{"train": 0.8, ...}``.

    Channels are among ``train``, ``validation`` and ``test`` (any subset); fractions must be
    positive and add up to 1 (within 1e-6); channel order is kept.
    """
    if isinstance(value, Mapping):
        items = list(value.items())
    elif not isinstance(value, str):
        raise ValueError(
            f"split must be a mapping like {{train: 0.8, validation: 0.2}} or a string like "
            f"'train=0.8,validation=0.2', got a {type(value).__name__}: {value!r}"
        )
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"split entries look like 'train=0.8', got {part.strip()!r} in {value!r}")
            name, frac = part.split("=", 1)
            items.append((name.strip(), frac.strip()))
    out: dict[str, float] = {}
    for name, frac in items:
        if name not in CHANNELS:
            raise ValueError(
                f"unknown channel {name!r} in split {_show(value)!r}; channels are "
                f"{', '.join(CHANNELS)} (any of them)"
            )
        if name in out:
            raise ValueError(f"channel {name!r} appears twice in split {value!r}")
        try:
            f = float(frac)
        except (TypeError, ValueError):
            raise ValueError(f"fraction of channel {name!r} must be a number, got {frac!r}") from None
        if not 0 < f <= 1:
            raise ValueError(f"fraction of channel {name!r} must be in (0, 1], got {f!r}")
        out[str(name)] = f
    if not out:
        raise ValueError(f"split names no channel: {value!r}")
    total = sum(out.values())
    if abs(total - 1) > 1e-6:
        raise ValueError(f"split fractions must add up to 1, got {total:g} from {value!r}")
    return out


def check_positive(
    name: str,
    value: Any,
    *,
    allow_none: bool = False,
    allow_zero: bool = False,
    error: type[Exception] = ValueError,
) -> None:
    """Raise ``error`` naming ``name`` unless ``value`` is a positive integer (or zero with
    ``allow_zero``, or None with ``allow_none``); a bool is not an integer here. A
    :class:`ConfigError` carries ``name`` as its ``option``."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        kind = "non-negative" if allow_zero else "positive"
        message = f"{name} must be a {kind} integer, got {value!r}"
        if issubclass(error, ConfigError):
            raise error(message, option=name)
        raise error(message)


def check_fraction(name: str, value: float) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is in ``[0, 1]``."""
    if not 0 <= value <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def parse_seed(value: Any) -> int:
    """A seed: an integer in ``[0, 2**32 - 1]``."""
    bad = ValueError(f"a seed must be an integer in [0, 2**32 - 1 = {MAX_SEED}], got {value!r}")
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise bad
    try:
        seed = int(value)
    except (TypeError, ValueError):
        raise bad from None
    if not 0 <= seed <= MAX_SEED:
        raise bad
    return seed


def parse_globs(value: str | Sequence[str]) -> tuple[str, ...]:
    """One glob or a list of them (a YAML list, or a repeated flag) -> a tuple of globs."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(g, str) and g for g in items):
        raise ValueError(f"expected a glob or a list of globs, got {value!r}")
    return tuple(items)


def opt(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    parse: Callable[[Any], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    flag: bool = True,
    const: str | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field with its help text, parser and choices for the command line.

    ``const``: the flag may be given without a value, meaning ``const`` (``--resume`` = auto).
    ``repeat``: the flag may be given several times; ``parse`` gets the list.
    """
    meta = {"help": help, "parse": parse, "choices": choices, "flag": flag, "const": const, "repeat": repeat}
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> Any:
    """``int | None`` -> int; ``str`` -> str."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _convert(cls: type, name: str, raw: Any, source: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    hints = typing.get_type_hints(cls)
    parse = field.metadata.get("parse")
    choices = field.metadata.get("choices")
    try:
        if raw is None:
            value = None
        elif parse is not None:
            value = parse(raw)
        else:
            base = _base_type(hints[name])
            if isinstance(raw, (list, tuple, set, dict)):
                hint = " (several values go in one comma-separated string)" if base is str else ""
                raise ValueError(
                    f"expected a single {getattr(base, '__name__', 'value')}, got a "
                    f"{type(raw).__name__}: {raw!r}{hint}"
                )
            if base is bool:
                if isinstance(raw, bool):
                    value = raw
                elif str(raw).lower() in ("true", "yes", "1", "on"):
                    value = True
                elif str(raw).lower() in ("false", "no", "0", "off"):
                    value = False
                else:
                    raise ValueError(f"expected true or false, got {raw!r}")
            elif base is int:
                if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                    raise ValueError(f"expected an integer, got {raw!r}")
                value = int(raw)
            elif base is float:
                if isinstance(raw, bool):
                    raise ValueError(f"expected a number, got {raw!r}")
                value = float(raw)
            else:
                value = str(raw)
        if choices is not None and value is not None and value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{_flag(name)} ({source}): {exc}") from None
    return value


def _named(exc: Exception, names: Sequence[str], sources: Mapping[str, str]) -> ConfigError:
    """A dataclass check's error as a :class:`ConfigError` naming the option and its source.

    The option is the error's own ``option`` where it has one (:class:`ConfigError`); else the
    field the message names first (``"num_shards must be a positive integer, got 0"`` or
    ``"cache_limit: a size must ..."``). It becomes the flag and its source, in place of the name
    the message starts with (``--num-shards (command line): must be a positive integer, got 0``).
    An error that names no field is kept as it is."""
    text = str(exc)
    name = exc.option if isinstance(exc, ConfigError) else None
    if name is None:
        m = re.match(r"(\w+)(: | )", text)
        name = m.group(1) if m is not None else None
    if name is None or name not in names:
        return exc if isinstance(exc, ConfigError) else ConfigError(text)
    if re.match(rf"{name}(: | )", text):
        text = text[len(name) :].removeprefix(":").lstrip(" ")
    return ConfigError(f"{_flag(name)} ({sources.get(name, 'default')}): {text}", option=name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per field of ``cls``; defaults stay ``None`` so that only what the user
    typed overrides the YAML file."""
    parser.add_argument(
        "--conf", metavar="YAML", help="a YAML file of these options (see conf/); flags override it"
    )
    for f in dataclasses.fields(cls):
        if not f.metadata.get("flag", True):
            continue
        base = _base_type(typing.get_type_hints(cls)[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "")
        if f.default is dataclasses.MISSING:
            help_text += " (required)"
        elif default not in (None, ()) and base is not bool:
            help_text += f" (default: {_show(default)})"
        if f.metadata.get("repeat"):
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                default=None,
                action="append",
                metavar=f.name.upper(),
                help=help_text + " (repeatable)",
            )
        elif base is bool:
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text + f" (default: {'on' if default else 'off'})",
            )
        else:
            extra = {"nargs": "?", "const": f.metadata["const"]} if f.metadata.get("const") else {}
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                default=None,
                metavar=f.name.upper(),
                choices=f.metadata.get("choices"),
                help=help_text,
                **extra,
            )


def _show(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
    return str(value)


def read_yaml(path: str, cls: type) -> dict[str, Any]:
    """The options set in the YAML file ``path``, keyed by field name; an unknown key is an
    error naming the key and the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of options, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, raw in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise ConfigError(f"unknown key {key!r} in {path}; known keys: {', '.join(sorted(names))}")
        out[name] = raw
    return out


def resolve(
    cls: type[T], args: argparse.Namespace | Mapping[str, Any] | None = None, *, conf: str | None = None
) -> T:
    """Build ``cls`` from its defaults, then the YAML file ``conf`` (or ``args.conf``), then
    the options in ``args`` that are not ``None``.

    Raises :class:`ConfigError` naming the option's flag and where its value came from, for
    a value its parser refuses and for one the dataclass's checks refuse (see :func:`_named`)."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    conf = conf or given.pop("conf", None)
    given.pop("conf", None)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if conf:
        for name, raw in read_yaml(conf, cls).items():
            values[name] = _convert(cls, name, raw, f"--conf {conf}")
            sources[name] = f"--conf {conf}"
    for name, raw in given.items():
        if raw is not None and name in names:
            values[name] = _convert(cls, name, raw, "command line")
            sources[name] = "command line"
    missing = [
        f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in values
    ]
    if missing:
        raise ConfigError(
            "missing required option(s): "
            + ", ".join(_flag(n) for n in missing)
            + (f" (not on the command line, nor in {conf})" if conf else "")
        )
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise _named(exc, names, sources) from None
