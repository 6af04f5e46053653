"""A command's flags and YAML keys for loader options, made from the options table.

A command's options dataclass (the trainer's ``TrainConfig``, the doctor's ``DoctorConfig``)
names the loader options it offers, each with its type (what a type checker reads), and marks
them :func:`from_loader`; :func:`loader_flags` fills in the rest from :data:`OPTIONS` (the
library's default, help text, choices) for :func:`lakeshard.settings.add_arguments` and
:func:`~lakeshard.settings.resolve`, and :func:`check_loader_flags` checks their values with the
options' own checks::

    @dataclass(frozen=True, slots=True)
    @loader_flags
    class DoctorConfig:
        batch_size: int = from_loader()
        cache_dir: str | None = from_loader()

        def __post_init__(self) -> None:
            check_loader_flags(self)

A command may give an option its own default (``augment: bool = from_loader(default=True)``:
the trainer augments); anything else about it is the library's.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, TypeVar

from lakeshard.settings import opt
from loaders.options.loader_options import OPTIONS
from loaders.options.table import run_check

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["check_loader_flags", "from_loader", "loader_flag_names", "loader_flags", "loader_values"]

C = TypeVar("C", bound=type)

_LIBRARY = object()  # from_loader(): the option's own default


@dataclasses.dataclass(frozen=True, slots=True)
class _FromLoader:
    """A field that is a loader option of the same name (filled in by :func:`loader_flags`)."""

    default: Any
    help: str | None


def from_loader(*, default: Any = _LIBRARY, help: str | None = None) -> Any:
    """Mark a field of a command's options as the loader option of its name: its flag and YAML
    key, default, help and check are the option's (:data:`OPTIONS`), but for a ``default`` or a
    ``help`` the command gives it."""
    return _FromLoader(default, help)


def loader_flags(cls: C) -> C:
    """Fill in the fields of ``cls`` marked :func:`from_loader` (apply it under ``@dataclass``).

    Raises:
        TypeError: a field named for no loader option, one that has no flag, or one whose type is
            not the flag's type in the options table (so the type checker sees what the flag gives).
    """
    annotations = inspect.get_annotations(cls)
    for name, value in list(vars(cls).items()):
        if not isinstance(value, _FromLoader):
            continue
        row = OPTIONS.get(name)
        if row is None or row.command_type is None:
            raise TypeError(f"{cls.__name__}.{name}: no loader option {name!r} is given on a command line")
        if annotations.get(name) != row.command_type:
            raise TypeError(
                f"{cls.__name__}.{name} is annotated {annotations.get(name)!r}; the loader option's flag "
                f"gives {row.command_type!r}"
            )
        flag = opt(
            row.default if value.default is _LIBRARY else value.default,
            help=value.help or row.help,
            choices=row.choices,
        )
        setattr(
            cls,
            name,
            dataclasses.field(default=flag.default, metadata={**flag.metadata, "loader_option": True}),
        )
    return cls


def loader_flag_names(config: DataclassInstance | type[DataclassInstance]) -> tuple[str, ...]:
    """The fields of a command's options that are loader options, in field order."""
    return tuple(f.name for f in dataclasses.fields(config) if f.metadata.get("loader_option"))


def loader_values(config: DataclassInstance) -> dict[str, Any]:
    """The loader options a command's options set, by name (the loaders' keywords)."""
    return {name: getattr(config, name) for name in loader_flag_names(config)}


def check_loader_flags(config: DataclassInstance) -> None:
    """Check each loader option of a command's options with the option's own check (a size
    parsed, say, but kept as given); a bad one is a :class:`ConfigError` naming the option."""
    for name in loader_flag_names(config):
        check = OPTIONS[name].check
        if check is not None:
            run_check(check, name, getattr(config, name))
