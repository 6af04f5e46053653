"""Every console command of ``pyproject.toml`` (``[project.scripts]``) is a ``main`` that
answers ``--help``, and every ``python -m`` command the docs show has one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def _scripts() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return dict(tomllib.load(fh)["project"]["scripts"])


def test_every_command_has_a_console_script() -> None:
    modules = {target.partition(":")[0] for target in _scripts().values()}
    shown = {
        m.group(1)
        for path in DOCS
        for m in re.finditer(r"python -m ((?:jobs|loaders|lakeshard)(?:\.\w+)+)", path.read_text("utf-8"))
    }
    assert shown, "the docs show no python -m command"
    assert shown <= modules, f"python -m commands with no [project.scripts] entry: {sorted(shown - modules)}"
    assert all(name.startswith("lakeshard-") for name in _scripts()), _scripts()


def test_every_console_script_answers_help() -> None:
    """Each entry's ``main(["--help"])`` exits 0 with a usage line naming the command, as the
    installed script's wrapper runs it (``sys.argv[0]`` its path, ``sys.exit(main())``); an
    entry naming a missing module or function fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {}
    for name, target in _scripts().items():
        module, _, func = target.partition(":")
        code = (
            f"import sys; sys.argv[0] = '/usr/local/bin/{name}'; "
            f"from {module} import {func}; sys.exit({func}(['--help']))"
        )
        runs[name] = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )  # all at once: each imports its command's engine or torch
    failed = {}
    for name, run in runs.items():
        out, _ = run.communicate(timeout=300)
        text = out.decode(errors="replace")
        if run.returncode != 0 or f"usage: {name} " not in text:
            failed[name] = f"exit {run.returncode}: {text[-600:]}"
    assert not failed, failed
