"""The jobs benchmark's two subcommands, shared by every tool's command line (``peer_common.main``
and ``jobs_lakeshard.py``): ``build`` runs the tool's ``build`` and prints what it returns as one
JSON line; ``stored`` prints ``<label> <sha256>`` per image the tool's format holds. Standard
library only: it runs in every tool's environment and adds nothing to a measured start."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["Build", "Stored", "add_build_commands", "lake_images", "run_build_command"]

#: ``build(lake, out, *, size, quality, workers)``: the raw lake into the tool's format under
#: ``out``; returns ``images`` written, and ``first_done`` and ``last_done``, the ``time.time()``
#: when the first and the last image's work finished (None: the tool does not tell).
Build = Callable[..., dict[str, Any]]
#: ``stored(out)``: every ``(label, image bytes)`` the tool's format under ``out`` holds.
Stored = Callable[[Path], Iterator[tuple[int, bytes]]]


def lake_images(lake: Path) -> list[tuple[Path, int]]:
    """Every ``<lake>/<class>/<file>.jpg`` with its label, the index of its class folder among
    the lake's class folders in sorted order; sorted by class, then file."""
    classes = sorted(p.name for p in lake.iterdir() if p.is_dir())
    return [
        (path, label) for label, name in enumerate(classes) for path in sorted((lake / name).glob("*.jpg"))
    ]


def add_build_commands(sub: Any) -> None:
    """``build`` and ``stored`` on ``sub`` (an ``ArgumentParser``'s subparsers)."""
    b = sub.add_parser("build", help="the jobs benchmark: the raw lake into this tool's format")
    b.add_argument("--lake", type=Path, required=True, help="the raw lake: <lake>/<class>/<file>.jpg")
    b.add_argument("--out", type=Path, required=True, help="an empty folder for this tool's files")
    b.add_argument("--size", type=int, required=True, help="side of the stored images, in pixels")
    b.add_argument("--quality", type=int, required=True, help="JPEG quality of the stored images")
    b.add_argument("--workers", type=int, required=True, help="processes or threads doing the work")
    d = sub.add_parser("stored", help="a line '<label> <sha256>' per image build stored")
    d.add_argument("--out", type=Path, required=True, help="the folder build wrote")


def run_build_command(args: argparse.Namespace, build: Build, stored: Stored) -> int:
    """Run ``args.command`` (``build`` or ``stored``) as :func:`add_build_commands` parsed it."""
    if args.command == "stored":
        for label, data in stored(args.out):
            print(label, hashlib.sha256(data).hexdigest())
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    done = build(args.lake, args.out, size=args.size, quality=args.quality, workers=args.workers)
    print(json.dumps(done), flush=True)
    return 0
