"""Frozen dataclasses to and from parsed JSON, checked field by field: the machinery of the
format's metadata models (``dataset.json``: :mod:`lakeshard.format.info`; ``_manifest.json``:
:mod:`lakeshard.format.manifest_info`).

A model's field holds another model, ``dict[str, T]``, ``list[T]``, ``T | None`` or a scalar. A
field with a default is optional on read (an older writer did not write it); a field whose
metadata says :data:`OMIT_NONE` is left out of the JSON when it is None (a variant of an object
that does not have it). A missing or mistyped field is a :class:`~lakeshard.errors.DatasetError`
naming the file and the field's path (``channels.train.shards[1].rows``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from lakeshard.errors import DatasetError

__all__ = ["OMIT_NONE", "from_json_document", "from_json_value", "model_of", "optional_of", "to_json_value"]

#: Field metadata: leave the field out of the JSON when its value is None.
OMIT_NONE: Mapping[str, bool] = types.MappingProxyType({"omit_none": True})

M = TypeVar("M")

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}


def model_of(hint: Any) -> type | None:
    """The class of a hint that is a model (a dataclass), else None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def optional_of(hint: Any) -> Any:
    """``T`` of a ``T | None`` hint, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def from_json_document(
    model: type[M], data: Any, source: str, *, versions: Collection[int], advice: Callable[[object], str]
) -> M:
    """The parsed JSON file ``source`` as ``model``, once its ``format_version`` is one of
    ``versions``; another version is a :class:`DatasetError`: ``<source> has format_version <v>``
    and ``advice(v)`` (what wrote it, what to do)."""
    if not isinstance(data, Mapping):
        raise DatasetError(f"{source} must hold a JSON object, got {type(data).__name__}")
    found = data.get("format_version")
    if found not in versions:
        raise DatasetError(f"{source} has format_version {found!r}{advice(found)}")
    return typing.cast(M, from_json_value(model, data, source, ""))


def from_json_value(hint: Any, value: Any, source: str, path: str) -> Any:
    """``value`` (parsed JSON at ``path`` of ``source``) as ``hint``: a model, ``dict[str, T]``,
    ``list[T]``, ``T | None`` or a scalar."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if (model := model_of(hint)) is not None:
        return _from_object(model, value, source, path)
    if (inner := optional_of(hint)) is not None:
        return None if value is None else from_json_value(inner, value, source, path)
    if origin is dict:
        if not isinstance(value, Mapping):
            _wrong(source, path, "an object", value)
        return {str(k): from_json_value(args[1], v, source, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            _wrong(source, path, "a list", value)
        return [from_json_value(args[0], v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return value  # a fraction another writer wrote as 1 is a number too (kept as written)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        _wrong(source, path, _TYPE_NAMES.get(hint, hint.__name__), value)
    return value


def _from_object(model: type, value: Any, source: str, path: str) -> Any:
    if not isinstance(value, Mapping):
        _wrong(source, path, "an object", value)
    hints = typing.get_type_hints(model)
    kwargs = {}
    for f in dataclasses.fields(model):
        where = f"{path}.{f.name}" if path else f.name
        if f.name not in value:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue  # an optional field an older writer did not write
            raise DatasetError(f"{source}: field {where} is missing")
        kwargs[f.name] = from_json_value(hints[f.name], value[f.name], source, where)
    try:
        return model(**kwargs)
    except ValueError as exc:  # the model's own check (an image size out of range, say)
        raise DatasetError(f"{source}: field {path or '(top level)'}: {exc}") from None


def _wrong(source: str, path: str, want: str, value: Any) -> typing.NoReturn:
    raise DatasetError(f"{source}: field {path or '(top level)'} must be {want}, got {value!r}")


def to_json_value(value: Any) -> Any:
    """The JSON value of a model, dict, list or scalar (plain dicts, lists and scalars)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json_value(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)
        }
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json_value(v) for v in value]
    return value
