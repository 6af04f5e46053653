"""The ``option=value,...`` variants of the A/B tools (``jobs_ab.py``, ``loader_ab.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def parse_variant(text: str, options: Iterable[str], owner: str) -> dict[str, object]:
    """``"partitions=4,threads=1"`` as keyword arguments: integers as ``int``, ``none`` as
    ``None``, anything else as text. A key that is not one of ``options`` is an
    ``ArgumentTypeError`` naming it (``owner``: whose options they are)."""
    known = set(options)
    out: dict[str, object] = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        if key not in known:
            raise argparse.ArgumentTypeError(f"{key!r} in variant {text!r} is not a {owner} option")
        out[key] = None if value == "none" else int(value) if value.lstrip("-").isdigit() else value
    return out
