"""What the benchmark tools' command lines share: argument types that name the bad value, the
work folder, a child process that answers in JSON, the log lines and the JSON they write. Not a
tool: imported by the tools beside it."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from _timing import write_json

__all__ = [
    "at_least",
    "int_list",
    "json_child",
    "log_to_stdout",
    "names",
    "positive",
    "run_checked",
    "work_folder",
    "write_out",
]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number (``100_000`` too) of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {minimum}")
        return value

    return parse


positive = at_least(1)


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive whole numbers (``100000,1_000_000``)."""
    try:
        values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive integers")
    return values


def names(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names among ``choices`` (``what`` they are)."""

    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(choices)}, got {text!r}")
        return values

    return parse


@contextlib.contextmanager
def work_folder(given: str | Path | None, *, prefix: str | None = None) -> Iterator[Path]:
    """``given`` (made if missing, and kept), else a temporary folder removed when the block ends."""
    if given is not None:
        path = Path(given).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def run_checked(cmd: Sequence[str], what: str, **run: Any) -> str:
    """Run ``cmd`` (``run``: more of :func:`subprocess.run`'s keywords) and return its output; a
    failure is a ``SystemExit`` naming ``what``, with the end of the child's error output."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, **run)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit code {done.returncode}):\n{done.stderr.strip()[-3000:]}")
    return done.stdout


def json_child(cmd: Sequence[str], what: str, **run: Any) -> dict[str, Any]:
    """:func:`run_checked`, and the JSON object on the last line of the child's output."""
    return dict(json.loads(run_checked(cmd, what, **run).strip().splitlines()[-1]))


def log_to_stdout() -> None:
    """Log lines as bare messages, without the S3 clients' notes ("Found credentials ...")."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("botocore", "aiobotocore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def write_out(out: Path | str | None, doc: Any) -> None:
    """``doc`` as JSON in ``out`` (:func:`_timing.write_json`), and a line saying so."""
    if out is not None:
        write_json(out, doc)
        print(f"wrote {out}")
