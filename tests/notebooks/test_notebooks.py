"""The notebooks run top to bottom, unedited, on a small dataset built here (nbclient), and are
committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from jobs.common.engines.local_engine import LocalEngine
from lakeshard.format import FOOTER_KEYS, read_dataset_info
from tests.helpers.datasets import build_dataset_with_rejects

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
CELL_TIMEOUT = 180  # seconds per cell; each notebook takes seconds on the small dataset

#: notebook -> the least number of image/png outputs (charts and grids) it must produce
EXPECTED_FIGURES = {"explore_manifests.ipynb": 5, "inspect_shards.ipynb": 3, "loader_profile.ipynb": 1}


def test_notebooks_are_committed_without_outputs():
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(EXPECTED_FIGURES)
    for name in found:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), f"{name} has outputs"
        assert "DATASET_URI" in code[0].source, f"{name}: the first code cell must choose the dataset"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three classes, two row groups or more per shard, one reject from each job."""
    return build_dataset_with_rejects(
        LocalEngine(),
        tmp_path_factory.mktemp("notebooks"),
        {"ant": 30, "bee": 24, "cow": 18},
        seed=5,
        row_group_size="8KiB",
    )


def _run(name: str, dataset: Path, monkeypatch: pytest.MonkeyPatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("DATASET_URI", str(dataset))  # the kernel inherits this process's environment
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # cwd = notebooks/, as in Jupyter; a failing cell raises CellExecutionError with its traceback.
    NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = sum(1 for o in outputs if "image/png" in o.get("data", {}))
    assert figures >= EXPECTED_FIGURES[name], f"{name}: {figures} figures"
    assert f"dataset: {dataset}" in _text(nb.cells[1]), "the notebook did not take $DATASET_URI"
    return nb


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for o in cell.get("outputs", []):
        parts.append(o.get("text", ""))
        data = o.get("data", {})
        parts += [data.get("text/plain", ""), data.get("text/html", ""), data.get("text/markdown", "")]
    return "\n".join(parts)


def _all_text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
def test_explore_manifests(dataset: Path, monkeypatch: pytest.MonkeyPatch):
    text = _all_text(_run("explore_manifests.ipynb", dataset, monkeypatch))
    info = read_dataset_info(str(dataset))
    assert f"{info.counts.listed} objects listed" in text
    assert "ant/notes.jpg" in text and "bee/broken.jpg" in text  # rejects of both jobs, by reason
    assert "not an image" in text and "cannot decode" in text


@pytest.mark.slow
def test_inspect_shards(dataset: Path, monkeypatch: pytest.MonkeyPatch):
    text = _all_text(_run("inspect_shards.ipynb", dataset, monkeypatch))
    info = read_dataset_info(str(dataset))
    assert info.dataset_version in text
    for channel, entry in info.channels.items():
        assert f"**{channel}**: rows per shard [{entry.rows_per_shard}]" in text
    assert "NOT uniform" not in text and text.count("→ uniform") == len(info.channels)
    assert all(key in text for key in FOOTER_KEYS)  # the footer, read by the format's opener


@pytest.mark.slow
def test_loader_profile(dataset: Path, monkeypatch: pytest.MonkeyPatch):
    nb = _run("loader_profile.ipynb", dataset, monkeypatch)
    text = _all_text(nb)
    assert "images_per_s" in text and "first_batch_ms" in text and "wait_ms_per_step" in text
    assert "best: " in text
