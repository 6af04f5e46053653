"""The commands the docs show are commands the code accepts, and CI runs the README's test
command."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.settings import add_arguments
from loaders.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")])

# How a command names each entry point, and the config dataclass its options come from.
ENTRY_POINTS = {
    "jobs.manifest": ManifestConfig,
    "jobs/manifest.py": ManifestConfig,
    "jobs.shard": ShardConfig,
    "jobs/shard.py": ShardConfig,
    "loaders.train": TrainConfig,
    "lakeshard-manifest": ManifestConfig,
    "lakeshard-shard": ShardConfig,
    "lakeshard-train": TrainConfig,
}

_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _flags(cls: type) -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return {s for a in parser._actions for s in a.option_strings}


def _commands(path: Path) -> list[tuple[str, list[str]]]:
    """``(entry point, its arguments)`` of every command in the fenced code blocks of ``path``
    that runs a job or the trainer."""
    found = []
    for block in _FENCE.findall(path.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].split("&&")[-1]
            try:
                words = shlex.split(line)
            except ValueError:
                continue
            for i, word in enumerate(words):
                run = word.endswith(".py") or word.startswith("lakeshard-") or (i and words[i - 1] == "-m")
                if word in ENTRY_POINTS and run:
                    found.append((word, words[i + 1 :]))
                    break
    return found


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = _FENCE.search(readme)
    assert first_block is not None, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "bash scripts/test.sh" in [line.strip() for line in ci], (
        ".ci/run does not run bash scripts/test.sh"
    )


def test_the_docs_show_commands() -> None:
    """The check below is not vacuous: the README shows each entry point."""
    shown = {entry for entry, _ in _commands(ROOT / "README.md")}
    assert {"jobs/manifest.py", "jobs/shard.py", "jobs.shard", "loaders.train"} <= shown, shown


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_use_options_that_exist(path: Path) -> None:
    unknown = []
    for entry, args in _commands(path):
        known = _flags(ENTRY_POINTS[entry]) | {"-h", "--help"}
        for arg in args:
            flag = arg.split("=")[0]
            if flag.startswith("--") and flag not in known:
                unknown.append(f"{entry} {flag}")
    assert not unknown, f"{path.relative_to(ROOT)} shows options the code does not have: {unknown}"
