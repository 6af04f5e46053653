"""Job configuration: one commented YAML file per job in ``conf/``, loaded into a frozen
dataclass, every key overridable from the command line.

The dataclass is the single source of truth: each field's ``metadata`` holds its help text
and parser, :func:`add_arguments` builds the argparse options from it, and :func:`resolve`
layers defaults < YAML file < command line, naming the option as the user types it
(``--num-shards``) and where its value came from (``command line``, ``--conf FILE`` or
``default``) in every error: the parsers' errors and the dataclass's own checks alike. The
option comes from the error as data (:attr:`ConfigError.option`), never from its message: a
parser's error is given the field it parsed, and a check raises a :class:`ConfigError` with
``option=`` (as :func:`check_positive`, :func:`check_fraction` and :func:`check_seed` do).

This layer knows no domain: it imports only :mod:`lakeshard.errors`, the standard library and
YAML (a test holds it to that); a domain's parsers (the manifest job's ``parse_split``) live
beside their domain.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from lakeshard.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "MAX_SEED",
    "add_arguments",
    "check_fraction",
    "check_positive",
    "check_seed",
    "command_name",
    "opt",
    "parse_globs",
    "parse_option",
    "parse_seed",
    "parse_size",
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
    """Raise a :class:`ConfigError` about ``name`` unless ``value`` is in ``[0, 1]``."""
    if not 0 <= value <= 1:
        raise ConfigError(f"{name} must be in [0, 1], got {value!r}", option=name)


def check_seed(name: str, value: Any) -> int:
    """``value`` as a seed, an ``int`` in ``[0, MAX_SEED]``; else a :class:`ConfigError` about
    ``name``. The one seed rule: the jobs', the trainer's and the loader's seeds all keep it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}", option=name)
    if value > MAX_SEED:
        raise ConfigError(f"{name} must be at most {MAX_SEED} (2**32 - 1), got {value!r}", option=name)
    return value


def parse_seed(value: Any) -> int:
    """A seed as typed or written in YAML (``"7"``, ``7``, ``7.0``): an integer in ``[0, MAX_SEED]``."""
    if isinstance(value, float) and value.is_integer():  # YAML's 7.0
        value = int(value)
    if isinstance(value, bool) or not re.fullmatch(r"\s*[0-9]+\s*", str(value)) or int(value) > MAX_SEED:
        raise ValueError(
            f"expected an integer from 0 to {MAX_SEED} (a seed is 32-bit, what numpy's and torch's "
            f"generators take): [0, 2**32 - 1 = {MAX_SEED}], got {value!r}"
        )
    return int(value)


def parse_option(name: str, parse: Callable[[Any], Any], value: Any) -> Any:
    """``parse(value)``, its ``ValueError`` as a :class:`ConfigError` about ``name``
    (``split: fractions must add up to 1, ...``): a dataclass's check of a parsed field."""
    try:
        return parse(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}", option=name) from None


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
        raise ConfigError(f"{_flag(name)} ({source}): {exc}", option=name) from None
    return value


def _located(exc: Exception, names: Sequence[str], sources: Mapping[str, str]) -> ConfigError:
    """A dataclass check's error as a :class:`ConfigError` naming the option's flag and source.

    The option is the error's ``option``, never read from its message: where it is a field of
    the dataclass, its flag and source stand in front of the message, in place of the option's
    name where the message starts with it (``num_shards must be a positive integer, got 0`` ->
    ``--num-shards (command line): must be a positive integer, got 0``). Any other error is
    kept as it is (as a :class:`ConfigError`)."""
    name = exc.option if isinstance(exc, ConfigError) else None
    if name is None or name not in names:
        return exc if isinstance(exc, ConfigError) else ConfigError(str(exc))
    text = str(exc)
    subject = next((s for s in (f"{name}: ", f"{name} ") if text.startswith(s)), "")
    where = f"{_flag(name)} ({sources.get(name, 'default')})"
    return ConfigError(f"{where}: {text[len(subject) :]}", option=name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def command_name(default: str) -> str:
    """The name a command's usage and error lines give it: the console command it was run as
    (``lakeshard-shard``, ``[project.scripts]``), else ``default`` (``jobs/shard.py``,
    ``python -m loaders.train``: how it was run otherwise)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("lakeshard-") else default


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
    a value its parser refuses and for one the dataclass's checks refuse (see :func:`_located`)."""
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
        raise _located(exc, names, sources) from None
