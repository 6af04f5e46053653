"""The loader's optional C extensions, ``loaders/_rows.c`` and ``loaders/_jpeg.c``.

``pip install`` builds them (``pyproject.toml``; a C compiler and libjpeg-turbo's headers are
needed). Where they were not built, or with ``LAKESHARD_NO_EXTENSIONS=1`` in the environment, the
loader uses its pure-Python paths instead: the same batches, slower.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

__all__ = ["extension"]

log = logging.getLogger(__name__)


def extension(name: str, fallback: str) -> Any:
    """The module ``loaders.<name>``, or ``None`` (logging ``fallback``, what is used instead)."""
    if os.environ.get("LAKESHARD_NO_EXTENSIONS"):
        return None
    try:
        return importlib.import_module(f"loaders.{name}")
    except ImportError:
        log.info("loaders.%s is not built; %s", name, fallback)
        return None
