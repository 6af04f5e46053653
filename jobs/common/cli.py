"""The command-line shell every job shares: options, logging, an engine, one exit code."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from jobs.common.engines import Engine, open_engine
from lakeshard.errors import PlatformError
from lakeshard.settings import add_arguments, command_name, resolve

__all__ = ["cli_main", "job_parser", "run_job"]

T = TypeVar("T")


def job_parser(
    prog: str, config: type[Any], *, description: str, epilog: str = ""
) -> argparse.ArgumentParser:
    """The job's argument parser: every field of ``config`` as an option (see
    :func:`lakeshard.settings.add_arguments`), with the YAML file and the AWS environment noted."""
    p = argparse.ArgumentParser(
        prog=command_name(prog),
        description=description,
        epilog=" ".join(
            filter(
                None,
                [
                    f"Options also come from a YAML file (--conf conf/{prog.rsplit('/', 1)[-1].removesuffix('.py')}.yaml); "
                    "flags override it. S3 endpoint and credentials come from the standard AWS environment "
                    "(AWS_ENDPOINT_URL, AWS_REGION, profiles, instance roles); Azure's from "
                    "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME with a key, a SAS token or "
                    "an Azure identity (docs/clusters.md).",
                    epilog,
                ],
            )
        ),
    )
    add_arguments(p, config)
    return p


def run_job(
    argv: list[str] | None,
    *,
    parser: argparse.ArgumentParser,
    config: type[Any],  # a dataclass of the job's options
    run: Callable[[Any, Engine], Any],
    summary: Callable[[Any, Any], str],
    prog: str,
    prepare: Callable[[Any], AbstractContextManager[Any]] | None = None,
    cpu_bound: bool = True,
) -> int:
    """Parse ``argv`` into ``config``, enter ``prepare(config)``, start its engine, ``run`` the
    job, print ``summary``. ``cpu_bound``: the job runs ``cpu_bound`` maps (the local engine
    starts their processes with it).

    ``prepare`` is the job's: it checks the inputs and takes the output's lock
    (:mod:`lakeshard.locks`), in the order the job needs, and holds the lock until the job
    ends (``run`` may take it again). It runs before the engine starts, so a bad input or a busy
    dataset fails in a second, not after the engine's start.

    Returns 0, or 2 with ``prog: error: ...`` on stderr for any error the platform raises on
    purpose (a bad option, a bad input, an existing dataset): see :func:`cli_main`.
    """
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its INFO lines are about its own sockets
    logging.getLogger("azure").setLevel(logging.WARNING)  # the Azure SDK logs every request at INFO

    def job() -> tuple[Any, Any]:
        cfg = resolve(config, args)
        with prepare(cfg) if prepare is not None else nullcontext():
            engine = open_engine(
                cfg.engine,
                scheduler=cfg.scheduler,
                app_name=f"lakeshard-{os.path.splitext(os.path.basename(prog))[0]}",
                start_processes=cpu_bound,
            )
            try:
                return cfg, run(cfg, engine)
            finally:
                engine.close()

    return cli_main(prog, job, lambda done: summary(*done))


def cli_main(prog: str, work: Callable[[], T], summary: Callable[[T], str]) -> int:
    """Do ``work`` and print its ``summary``; return 0, or 2 with one ``prog: error: ...`` line
    on stderr for an error the platform raises on purpose (those name the value and the place,
    so a traceback would only hide them)."""
    try:
        done = work()
    except PlatformError as exc:
        print(f"{command_name(prog)}: error: {exc}", file=sys.stderr)
        return 2
    print(summary(done))
    return 0
