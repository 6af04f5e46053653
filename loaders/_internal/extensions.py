"""The loader's optional C extensions, ``loaders/_rows.c`` and ``loaders/_jpeg.c``.

``pip install`` builds them where it finds a C compiler (and, for ``_jpeg``, libjpeg's headers;
``scripts/setup.sh`` checks). Where they were not built, or with ``LAKESHARD_NO_EXTENSIONS=1`` in
the environment, the loader uses its pure-Python paths instead: the same batches, slower.

Nothing is logged at import (logging is usually not configured yet). The first time a loader
takes a pure-Python path instead of an extension, :func:`fall_back` logs one WARNING naming the
extension and what its absence costs, once per extension and process.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

__all__ = ["extension", "fall_back"]

log = logging.getLogger(__name__)

#: Why each extension asked for is missing, and what that costs: ``name -> (why, lost)``.
_missing: dict[str, tuple[str, str]] = {}
_warned: set[str] = set()
_lock = threading.Lock()


def extension(name: str, lost: str) -> Any:
    """The module ``loaders.<name>``, or ``None``. ``lost`` says what the pure-Python path costs
    (``"JPEGs are decoded image by image with simplejpeg (slower)"``); :func:`fall_back` logs it."""
    if os.environ.get("LAKESHARD_NO_EXTENSIONS"):
        _missing[name] = ("is switched off (LAKESHARD_NO_EXTENSIONS is set)", lost)
        return None
    try:
        return importlib.import_module(f"loaders.{name}")
    except ImportError as exc:  # not built, or built but not loadable (no libjpeg.so, for instance)
        not_built = isinstance(exc, ModuleNotFoundError) and exc.name == f"loaders.{name}"
        _missing[name] = ("is not built" if not_built else f"cannot be loaded ({exc})", lost)
    return None


def fall_back(name: str) -> None:
    """Call where a loader takes its pure-Python path because ``loaders.<name>`` is missing: the
    first call for ``name`` in this process logs a WARNING, later calls nothing."""
    if name in _warned:  # the common case, without the lock
        return
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    why, lost = _missing.get(name, ("is missing", "a slower pure-Python path is used"))
    log.warning("loaders.%s %s: %s; see docs/performance.md", name, why, lost)
