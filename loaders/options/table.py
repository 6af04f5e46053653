"""An option's definition, written once where the option is a field: :func:`option` gives the
field its default, help text, check and command-line type, and :class:`Option` is the row of
the options table (:data:`loaders.options.OPTIONS`) read back from it.

The loader's constructors, the trainer's and the doctor's flags and their YAML keys all come
from these rows: the same name, default, help and check everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lakeshard.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["DEFAULT", "Check", "Option", "check_fields", "option", "rows"]

#: How an option's value is checked: ``check(name, value)`` returns the value as kept (a size
#: parsed, lists made tuples) or raises a :class:`ConfigError` naming ``name``.
Check = Callable[[str, Any], Any]


class _Default:
    """The default of a loader's keyword: the keyword was not given (its value is then the
    option's default, or the group's or the ``options=``' value)."""

    def __repr__(self) -> str:
        return "DEFAULT"


#: A keyword of ``ShardLoader``/``MixedLoader`` left out (typed ``Any`` so that a parameter
#: ``batch_size: int = DEFAULT`` keeps its own type).
DEFAULT: Any = _Default()


def option(
    default: Any,
    *,
    help: str,
    check: Check | None = None,
    command: str | bool = True,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A field that is a loader option: its ``default``, its ``help`` (the ``--help`` text of its
    flags), its ``check`` and how a command line gives it: ``command=True``: a flag of the
    field's own type; a string: a flag of that type (``"str | None"`` for a transform, given by
    reference); ``False``: no flag (a Python object). ``choices`` bound a string flag."""
    meta = {"help": help, "check": check, "command": command, "choices": choices}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Option:
    """One row of the options table.

    Attributes:
        name: the keyword, the attribute of :class:`~loaders.options.LoaderOptions`, the YAML key.
        group: the :class:`~loaders.options.LoaderOptions` field of its group (``"reads"``), or
            ``None`` for the common options that are fields of their own.
        type: its annotation, as written.
        default: the library's default (a flag's default too, unless a command says otherwise).
        help: what it does, in a line or two (the flags' ``--help`` text).
        check: how its value is checked (``None``: by its group, with other options).
        command_type: the annotation of a command's field for it (``None``: no flag).
        choices: the values a string flag takes, where they are fixed.
    """

    name: str
    group: str | None
    type: str
    default: Any
    help: str
    check: Check | None
    command_type: str | None
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        """The command-line flag: ``--read-concurrency``."""
        return "--" + self.name.replace("_", "-")


def rows(cls: type[DataclassInstance], group: str | None) -> list[Option]:
    """The options table's rows of the fields of ``cls`` made by :func:`option`."""
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        command = f.metadata["command"]
        command_type = None if command is False else (f.type if command is True else command)
        out.append(
            Option(
                name=f.name,
                group=group,
                type=str(f.type),
                default=f.default,
                help=f.metadata["help"],
                check=f.metadata["check"],
                command_type=None if command_type is None else str(command_type),
                choices=f.metadata["choices"],
            )
        )
    return out


def check_fields(obj: DataclassInstance) -> None:
    """Check each option field of the frozen dataclass ``obj``, in field order, keeping what
    each check returns; an error that does not name its option is given it."""
    for f in dataclasses.fields(obj):
        check = f.metadata.get("check")
        if check is not None:
            object.__setattr__(obj, f.name, run_check(check, f.name, getattr(obj, f.name)))


def run_check(check: Check, name: str, value: Any) -> Any:
    """``check(name, value)``, its :class:`ConfigError` carrying ``option=name``."""
    try:
        return check(name, value)
    except ConfigError as exc:
        if exc.option is None:
            exc.option = name
        raise
