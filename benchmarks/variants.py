"""What the A/B tools share (``jobs_ab.py``, ``loader_ab.py``, ``loader_gil.py``): ``option=value,...``
variants, and their JSON output."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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


def write_runs(out: Path | None, args: argparse.Namespace, runs: dict[str, Any]) -> None:
    """Write the command line's arguments and every run to ``out`` as JSON (nothing if ``None``)."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"args": {k: str(x) for k, x in vars(args).items()}, "runs": runs}, indent=2) + "\n"
        )
