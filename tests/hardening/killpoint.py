"""Run a job's ``main`` and die (``os._exit(137)``, as a SIGKILL would leave things) at an exact
step of its commit sequence, for the kill-during-commit tests. Nothing else is changed: the job,
its engine and its storage calls are the real ones; only the moment of death is chosen.

    python -m tests.hardening.killpoint FUNC:URI_SUFFIX:before|after jobs.shard --engine dask ...

``FUNC`` is a function of :mod:`lakeshard.storage` (or ``write_report``, the report writer the shard
job calls after its commit); death comes at its first call whose URI argument ends with ``URI_SUFFIX``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys


def _arm(point: str) -> None:
    import jobs.shard
    from lakeshard import storage

    func, suffix, when = point.split(":")
    owner = jobs.shard if func == "write_report" else storage
    original = getattr(owner, func)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        uri = str(args[0]) if args else ""
        hit = uri.rstrip("/").endswith(suffix)
        if hit and when == "before":
            os._exit(137)
        result = original(*args, **kwargs)
        if hit and when == "after":
            os._exit(137)
        return result

    setattr(owner, func, wrapper)


def main() -> int:
    point, module, *argv = sys.argv[1:]
    _arm(point)
    return importlib.import_module(module).main(argv)


if __name__ == "__main__":
    sys.exit(main())
