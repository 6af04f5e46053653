"""The tree shows the architecture, and the imports keep to it.

- ``lakeshard`` (the shared core: errors, storage, settings, locks, the format) is below both
  ``jobs`` and ``loaders``, which never import each other.
- ``jobs/`` holds at its top only the commands users run; ``jobs.common`` (engines, the command
  shell, tasks, images) imports neither job's package; the two jobs' packages
  (``jobs.manifest_steps``, ``jobs.shard_steps``) import each other's nothing and no command.
- ``loaders`` (the library) never imports its example trainer, ``loaders.train``.
- ``lakeshard.settings`` imports of ours only ``lakeshard.errors``: it knows no domain.
- The import graph of our modules has no cycle, and a module's name means one thing.
- ``docs/design/0029-layout.md`` names every module (the tree a newcomer reads).
- Which store a URI names is decided in ``lakeshard/storage/`` only (its table of stores and the
  stores themselves): no other module tests a URI's scheme by its prefix (a new store is a
  module there, registered by its scheme).
- A module is one concept: none over 500 lines and no function over 80 in any package (in
  ``loaders/``, no class over 300 lines and no function over 60).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lakeshard", "jobs", "loaders")

#: module prefix -> the module prefixes of ours it must not import.
FORBIDDEN = {
    "lakeshard": ("jobs", "loaders"),
    "loaders": ("jobs", "loaders.train"),
    "loaders.train": ("jobs",),
    "loaders.doctor": ("jobs",),  # a command above the library, as the trainer is: it builds models with it
    "jobs": ("loaders",),
    "jobs.common": (
        "jobs.manifest_steps",
        "jobs.shard_steps",
        "jobs.manifest",
        "jobs.shard",
        "jobs.versions",
        "jobs.report",
    ),
    "jobs.manifest_steps": (
        "jobs.shard_steps",
        "jobs.manifest",
        "jobs.shard",
        "jobs.versions",
        "jobs.report",
    ),
    "jobs.shard_steps": (
        "jobs.manifest_steps",
        "jobs.manifest",
        "jobs.shard",
        "jobs.versions",
        "jobs.report",
    ),
}

#: What ``jobs/`` holds at its top: the commands, the script helper and the three packages.
JOBS_TOP = {
    "__init__.py",
    "_script.py",
    "build.py",
    "manifest.py",
    "shard.py",
    "versions.py",
    "spark_cds.py",
    "report.py",
    "common",
    "manifest_steps",
    "shard_steps",
}

#: Module names that stand in several packages, each time for the same role in its package.
SAME_ROLE = {
    "__init__": "a package",
    "__main__": "python -m <package>",
    "config": "the options dataclass of its job (manifest, shard, trainer)",
    "inputs": "the checks of its job's inputs before an engine starts (manifest, shard)",
    "versions": "the shard versions on S3: the format's model of them and the command over them",
}


def _modules() -> dict[str, Path]:
    """Every module of ours by dotted name (a package by its ``__init__``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The modules of ours ``path`` (module ``name``) imports, anywhere in the file: for
    ``from a.b import c``, ``a.b.c`` if it is a module, else ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and _is_type_checking(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }  # not imported when the code runs
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found - {name}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, name, modules) for name, path in modules.items()}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_each_layer_imports_only_what_is_below_it():
    graph = _graph()
    wrong = []
    for name, targets in sorted(graph.items()):
        rules = [p for p in FORBIDDEN if _under(name, p)]
        rule = max(rules, key=len) if rules else None  # the most specific layer the module is in
        if rule is None:
            continue
        for target in sorted(targets):
            bad = [f for f in FORBIDDEN[rule] if _under(target, f) and not _under(name, f)]
            if bad:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_settings_layer_knows_no_domain():
    """``lakeshard.settings`` (fields to flags and YAML, where a value came from) imports of
    ours only the errors: a domain's parsers live beside their domain, not below it."""
    assert _graph()["lakeshard.settings"] <= {"lakeshard.errors"}


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    # A package's __init__ that re-exports its own modules is not a cycle of the design: drop
    # edges from a package to the modules below it before judging.
    real = []
    for component in cycles:
        inner = {v: {w for w in graph[v] if w in component and not _under(w, v)} for v in component}
        if any(inner.values()) and _has_cycle(inner):
            real.append(component)
    assert not real, f"import cycles: {real}"


def _has_cycle(graph: dict[str, set[str]]) -> bool:
    state: dict[str, int] = {}

    def visit(v: str) -> bool:
        state[v] = 1
        for w in graph.get(v, ()):
            if state.get(w) == 1 or (w not in state and visit(w)):
                return True
        state[v] = 2
        return False

    return any(visit(v) for v in graph if v not in state)


def test_a_cycle_is_found_when_there_is_one(tmp_path: Path):
    """The cycle check itself can fail: two modules importing each other are a cycle."""
    assert _has_cycle({"a": {"b"}, "b": {"a"}}) and not _has_cycle({"a": {"b"}, "b": set()})
    assert _has_cycle({"p.x": {"p.y"}, "p.y": {"p.z"}, "p.z": {"p.x"}})


def test_jobs_top_level_holds_only_the_commands():
    found = {p.name for p in (REPO / "jobs").iterdir() if p.name != "__pycache__"}
    assert found == JOBS_TOP


def test_a_module_name_means_one_thing():
    by_name = defaultdict(list)
    for name in _modules():
        by_name[
            name.rpartition(".")[2] if not (REPO / name.replace(".", "/")).is_dir() else "__init__"
        ].append(name)
    repeated = {k: v for k, v in by_name.items() if len(v) > 1 and k not in SAME_ROLE}
    assert not repeated, repeated


def test_the_layout_record_names_every_module():
    record = (REPO / "docs" / "design" / "0029-layout.md").read_text()
    listed = set(re.findall(r"`((?:jobs|lakeshard|loaders)/[\w/]+\.py)`", record))
    modules = {str(p.relative_to(REPO)) for p in _modules().values()} - {
        str(p.relative_to(REPO))
        for p in _modules().values()
        if p.name == "__init__.py" and not p.read_text().strip()
    }
    assert modules - listed == set(), "modules missing from docs/design/0029-layout.md"
    assert listed - modules == set(), "docs/design/0029-layout.md names modules that do not exist"


#: Code that decides by a URI's scheme prefix: ``uri.startswith("s3://")``, ``uri[len("file://"):]``,
#: ``"s3://" + path``, ``"s3://" if ... else "file://"``, ``removeprefix("file://")``.
_SCHEME_TEST = re.compile(
    r"""(startswith|removeprefix|removesuffix|len)\(\(?\s*["'](s3a?|file|gs|az)://"""
    r"""|["'](s3a?|file|gs|az)://["']\s*(\+|if\b)"""
)


#: The modules that know a scheme's spelling: the table of stores and the stores themselves.
_STORE_MODULES = {"lakeshard/storage/_registry.py", "lakeshard/storage/_local.py", "lakeshard/storage/_s3.py"}


def test_only_storage_decides_by_a_uris_scheme():
    found = []
    for path in _modules().values():
        if path.relative_to(REPO).as_posix() in _STORE_MODULES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _SCHEME_TEST.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], (
        "ask lakeshard.storage (store_for, is_local, scheme, local_path, bucket, from_listing):\n"
        + "\n".join(found)
    )


def test_the_scheme_check_finds_a_prefix_test():
    for line in (
        'if uri.startswith("s3://"):',
        "p = uri[len('file://'):]",
        'x = ("s3://" if a else "file://") + p',
    ):
        assert _SCHEME_TEST.search(line), line
    assert not _SCHEME_TEST.search('raise ValueError(f"not an s3:// URI: {uri}")')


def test_the_training_side_loads_no_engine():
    code = (
        "import json, sys\n"
        "import loaders, loaders.train, loaders.petastorm_compat  # noqa: F401\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'dask', 'distributed', 'jobs'})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize(
    "command",
    [
        "jobs.manifest",
        "jobs.shard",
        "jobs.versions",
        "jobs.report",
        pytest.param("loaders.train", marks=pytest.mark.slow),
    ],
)  # imports torch: ~3 s
def test_every_command_answers_help(command: str):
    proc = subprocess.run(
        [sys.executable, "-m", command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


#: Private names tests may read: a named tuple's own methods, argparse's parsed flags (the docs
#: tests list them), and the tests' own helpers.
_PRIVATE_ALLOWED = {"_replace", "_asdict", "_fields", "_actions"}
_PRIVATE_OWNERS = {"self", "cls", "sys", "os", "proxy"}


def _private_reads(source: str) -> list[str]:
    """``obj._name`` reads in ``source`` of an object that is not an imported module (tests of
    internals import them openly; a loader's private attributes are not read)."""
    tree = ast.parse(source)
    modules = {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in _PRIVATE_ALLOWED
        and ast.unparse(node.value) not in _PRIVATE_OWNERS | modules
    ]


def test_no_test_reads_a_private_attribute():
    found = {
        str(path.relative_to(REPO)): reads
        for path in sorted((REPO / "tests").rglob("*.py"))
        if (reads := _private_reads(path.read_text()))
    }
    assert found == {}


def test_a_private_read_is_found():
    assert _private_reads("def f(loader):\n    return loader._reader.pieces\n") == ["2: loader._reader"]
    assert _private_reads("from loaders import extensions\nextensions._missing\n") == []


def test_the_loader_library_keeps_its_sizes():
    """No class in ``loaders/`` over 300 lines, no function over 60 (issue 46: what one class or
    one function holds stays readable)."""
    over = []
    for path in sorted((REPO / "loaders").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = 300 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.end_lineno - node.lineno + 1 > limit:
                over.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert over == []


#: What one module and one function of ours may hold (issue 48: a module is one concept).
MODULE_LINES, FUNCTION_LINES = 500, 80


@pytest.mark.parametrize(
    "package",
    ["lakeshard", "jobs", "loaders"],
)
def test_every_package_keeps_its_sizes(package: str):
    """No module over :data:`MODULE_LINES` lines, no function over :data:`FUNCTION_LINES`."""
    assert _oversized(REPO / package) == []


def _oversized(root: Path) -> list[str]:
    """The modules and functions under ``root`` over the sizes, named from ``root``'s parent."""
    over = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if (lines := len(source.splitlines())) > MODULE_LINES:
            over.append(f"{path.relative_to(root.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and (size := node.end_lineno - node.lineno + 1) > FUNCTION_LINES
            ):
                over.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {size} lines")
    return over


def test_the_size_check_finds_a_long_module_and_function(tmp_path: Path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    body = "".join(f"    y{i} = {i}\n" for i in range(FUNCTION_LINES))
    (tmp_path / "short.py").write_text(f"def f():\n{body}")
    assert _oversized(tmp_path) == [
        f"{tmp_path.name}/long.py: {MODULE_LINES + 1} lines",
        f"{tmp_path.name}/short.py:1 f: {FUNCTION_LINES + 1} lines",
    ]
