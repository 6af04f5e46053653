"""The command-line shell every job shares: options, logging, an engine, one exit code."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from jobs.engines import Engine, open_engine
from jobs.inputs import INPUT_CHECKS
from lakeshard.config import resolve
from lakeshard.errors import PlatformError

__all__ = ["run_job"]


def run_job(argv: list[str] | None, *, parser: argparse.ArgumentParser, config: type,
            run: Callable[[Any, Engine], Any], summary: Callable[[Any, Any], str], prog: str,
            check: Callable[[Any], Any] | None = None) -> int:
    """Parse ``argv`` into ``config``, ``check`` its inputs, start its engine, ``run`` the job,
    print ``summary``.

    ``check`` (default: the check :data:`jobs.inputs.INPUT_CHECKS` has for ``config``) runs
    before the engine starts, so a bad input fails in a second, not after the engine's start.

    Returns 0, or 2 with ``prog: error: ...`` on stderr for any error the platform raises on
    purpose (a bad option, a bad input, an existing dataset): those name the value and the
    place, so a traceback would only hide them.
    """
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its INFO lines are about its own sockets
    try:
        cfg = resolve(config, args)
        (check or INPUT_CHECKS.get(config) or _no_check)(cfg)
        engine = open_engine(cfg.engine, scheduler=cfg.scheduler, app_name=f"lakeshard-{os.path.splitext(os.path.basename(prog))[0]}")
        try:
            result = run(cfg, engine)
        finally:
            engine.close()
    except PlatformError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(summary(cfg, result))
    return 0


def _no_check(cfg: Any) -> None:
    """A job with nothing to check before its engine starts."""
