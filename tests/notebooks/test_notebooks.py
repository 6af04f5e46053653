"""The notebooks run top to bottom, unedited, on small datasets built here (nbclient): a
single-label one, and a multi-label and a boxes one from a lake of drawn shapes; and are
committed without outputs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from jobs.common.engines.local_engine import LocalEngine
from lakeshard.format import FOOTER_KEYS, channel_shards, open_shard, read_dataset_info
from lakeshard.format.label_columns import BOXES, MULTI_LABEL, SINGLE_LABEL
from tests.helpers.datasets import ShapesDataset, build_dataset_with_rejects, build_shapes_dataset

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
CELL_TIMEOUT = 180  # seconds per cell; each notebook takes seconds on the small dataset

#: notebook -> task kind -> the image/png outputs (charts and grids) it makes: the single-label
#: dataset has rejects (a chart), the shapes lakes none; beyond single-label, labels (and boxes)
#: per image and, for boxes, box sizes
EXPECTED_FIGURES = {
    "explore_manifests.ipynb": {SINGLE_LABEL: 5, MULTI_LABEL: 5, BOXES: 6},
    "inspect_shards.ipynb": {SINGLE_LABEL: 3, MULTI_LABEL: 4, BOXES: 5},
    "loader_profile.ipynb": {SINGLE_LABEL: 1, MULTI_LABEL: 1, BOXES: 1},
}


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


@pytest.fixture(scope="module", params=[MULTI_LABEL, BOXES])
def shapes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ShapesDataset:
    """A multi-label or a boxes dataset of 48 drawn images, and what each holds."""
    return build_shapes_dataset(
        LocalEngine(), tmp_path_factory.mktemp(request.param), request.param, n=48, seed=5
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
    expected = EXPECTED_FIGURES[name][read_dataset_info(str(dataset)).task_kind]
    assert figures == expected, f"{name}: {figures} figures, expected {expected}"
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


def _per_image(kind: str, counts: Iterable[int]) -> str:
    """The notebooks' line of how many images hold how many ``kind`` (labels, boxes)."""
    return f"{kind} per image: " + ", ".join(f"{k}: {v} images" for k, v in sorted(Counter(counts).items()))


def _shard_keys(dataset: Path) -> list[str]:
    """The key of every row of every shard of ``dataset``, read through the format's opener."""
    info = read_dataset_info(str(dataset))
    keys = []
    for channel in info.channels:
        for uri, _ in channel_shards(str(dataset), info, channel):
            with open_shard(uri) as opened:
                keys += opened.parquet.read(columns=["key"])["key"].to_pylist()
    return keys


@pytest.mark.slow
def test_explore_manifests_beyond_one_class(shapes: ShapesDataset, monkeypatch: pytest.MonkeyPatch):
    """An image counts once per label it holds; labels and boxes per image are what the lake drew."""
    dataset, drawn = shapes.root, shapes.drawn
    text = _all_text(_run("explore_manifests.ipynb", dataset, monkeypatch))
    task = read_dataset_info(str(dataset)).task_kind
    assert f"a {task} dataset: {sum(len(d.labels) for d in drawn)} labels on {len(drawn)} images" in text
    assert _per_image("labels", (len(d.labels) for d in drawn)) in text
    if task == BOXES:
        assert _per_image("boxes", (len(d.shapes) for d in drawn)) in text
        assert f"{sum(len(d.shapes) for d in drawn)} boxes on {len(drawn)} images" in text
    else:
        assert "boxes per image" not in text and f"no boxes: a {task} dataset" in text


@pytest.mark.slow
def test_inspect_shards_beyond_one_class(shapes: ShapesDataset, monkeypatch: pytest.MonkeyPatch):
    """Labels and boxes per image are what the lake drew on the images the shards hold (none of
    the padded images' boxes cropped away); shards of equal rows are uniform, labels unbalanced."""
    dataset, drawn = shapes.root, shapes.drawn
    text = _all_text(_run("inspect_shards.ipynb", dataset, monkeypatch))
    info = read_dataset_info(str(dataset))
    held = [d for key in _shard_keys(dataset) for d in drawn if d.key == key]
    assert len(held) == sum(entry.rows for entry in info.channels.values())
    assert _per_image("labels", (len(d.labels) for d in held)) in text
    if info.task_kind == BOXES:
        assert _per_image("boxes", (len(d.shapes) for d in held)) in text
        assert f"{sum(len(d.shapes) for d in held)} boxes on {len(held)} images" in text
    assert "NOT uniform" not in text and text.count("→ uniform") == len(info.channels)


@pytest.mark.slow
def test_loader_profile_beyond_one_class(shapes: ShapesDataset, monkeypatch: pytest.MonkeyPatch):
    text = _all_text(_run("loader_profile.ipynb", shapes.root, monkeypatch))
    assert "images_per_s" in text and "best: " in text
