"""The packages' layering: ``lakeshard`` (the shared core) is below both ``jobs`` and ``loaders``,
which never import each other; the training side never pulls in an engine."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: package -> the top-level packages of ours it must not import.
FORBIDDEN = {
    "lakeshard": {"jobs", "loaders"},
    "loaders": {"jobs"},
    "jobs": {"loaders"},
}


def _imports(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_what_is_below_it(package: str):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no modules found under {package}/"
    wrong = {str(f.relative_to(REPO)): sorted(_imports(f) & FORBIDDEN[package]) for f in files}
    assert not {f: names for f, names in wrong.items() if names}


def test_the_training_side_loads_no_engine():
    code = (
        "import json, sys\n"
        "import loaders, loaders.train, loaders.petastorm_compat  # noqa: F401\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'dask', 'distributed', 'jobs'})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
