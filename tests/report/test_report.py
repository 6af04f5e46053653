"""report.html: written by the shard job before dataset.json, rewritten by ``python -m jobs.report``,
self-contained, and rendered by a real (headless) Chromium with its charts and thumbnails."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jobs import shard as shard_job
from jobs.engines.spark_engine import SparkEngine
from jobs.settings import ShardConfig
from lakeshard.format import manifest_rejects_uri, shard_rejects_uri
from tests.helpers.checks import read_table, shard_tables
from tests.helpers.datasets import build_dataset_with_rejects

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SAMPLES_PER_CLASS = 6  # write_report's default


@pytest.fixture(scope="module")
def dataset(spark, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three classes, one object the manifest job rejects and one the shard job rejects."""
    return build_dataset_with_rejects(spark, tmp_path_factory.mktemp("report"), {"cat": 24, "dog": 18, "fox": 10}, seed=3)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _tags(html: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Tags()
    parser.feed(html)
    return parser.tags


def test_shard_job_writes_a_self_contained_report(dataset: Path):
    report, dataset_json = dataset / "report.html", dataset / "dataset.json"
    assert report.exists()
    assert report.stat().st_mtime_ns <= dataset_json.stat().st_mtime_ns  # dataset.json stays the last file
    info = json.loads(dataset_json.read_text())
    html = report.read_text()
    tags = _tags(html)
    names = [t for t, _ in tags]

    # Self-contained: nothing fetched, nothing run.
    assert "script" not in names and "link" not in names
    assert not [a for _, a in tags for k in ("src", "href") if (a.get(k) or "").startswith(("http:", "https:", "//"))]

    # Charts: class counts, splits, rejects, shard balance, each an inline SVG with bars.
    assert names.count("svg") == 4
    assert names.count("rect") >= 3 * 3 + 3 * 2 + 2 + 3 * 2

    # Thumbnails: the shards' own bytes as data URIs, up to SAMPLES_PER_CLASS per class of train.
    train = shard_tables(str(dataset), "train", 2)
    train_images = {b for t in train for b in t["image"].to_pylist()}
    train_labels = [label for t in train for label in t["label"].to_pylist()]
    srcs = [a["src"] for t, a in tags if t == "img"]
    expected = sum(min(SAMPLES_PER_CLASS, train_labels.count(i)) for i in info["labels"].values())
    assert len(srcs) == expected > 0
    for src in srcs:
        head, _, payload = src.partition(",")
        assert head == "data:image/png;base64"
        data = base64.b64decode(payload)
        assert data in train_images
        assert Image.open(io.BytesIO(data)).size == (24, 24)

    # Counts, rejects with their reasons, lineage.
    manifest_rejects = read_table(manifest_rejects_uri(str(dataset)))
    shard_rejects = read_table(shard_rejects_uri(str(dataset)))
    assert manifest_rejects.num_rows == 1 and shard_rejects.num_rows == 1
    for reason in manifest_rejects["reason"].to_pylist() + shard_rejects["reason"].to_pylist():
        assert reason.split(":", 1)[0] in html
    assert "cat/notes.jpg" in html and "dog/broken.jpg" in html
    assert "Rejects (2)" in html
    assert f"<td>{info['counts']['listed']}</td>" in html
    for value in (info["dataset_version"], info["inputs"]["manifest_fingerprint"], info["versions"]["pyarrow"]):
        assert str(value) in html
    for channel, entry in info["channels"].items():
        assert f"rows per shard: [{entry['rows_per_shard']}]" in html
        assert f"<td>{channel}</td>" in html


def test_cli_rewrites_the_same_report(dataset: Path, tmp_path: Path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    original = (copy / "report.html").read_bytes()
    (copy / "report.html").unlink()
    proc = subprocess.run([sys.executable, "-m", "jobs.report", str(copy)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "report.html" in proc.stdout
    rewritten = (copy / "report.html").read_bytes()
    assert rewritten.replace(str(copy).encode(), b"") == original.replace(str(dataset).encode(), b"")

    help_ = subprocess.run([sys.executable, "-m", "jobs.report", "--help"], cwd=REPO, capture_output=True, text=True)
    assert help_.returncode == 0 and "dataset.json" in help_.stdout

    (copy / "dataset.json").unlink()
    missing = subprocess.run([sys.executable, "-m", "jobs.report", str(copy)], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2
    assert "dataset.json does not exist" in missing.stderr and str(copy) in missing.stderr


def _chromium(*args: str, user_data: Path) -> subprocess.CompletedProcess[str]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup_test_extras.sh (or set CHROMIUM)")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           f"--user-data-dir={user_data}", "--run-all-compositor-stages-before-draw", "--virtual-time-budget=5000",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_report_renders_in_chromium(dataset: Path, tmp_path: Path):
    url = (dataset / "report.html").resolve().as_uri()
    dom = _chromium("--dump-dom", url, user_data=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    tags = _tags(dom.stdout)
    assert [t for t, _ in tags].count("svg") == 4
    assert sum(1 for t, a in tags if t == "img" and (a.get("src") or "").startswith("data:image/png")) > 0

    shot = tmp_path / "report.png"
    proc = _chromium(f"--screenshot={shot}", "--window-size=1200,3000", url, user_data=tmp_path / "profile-shot")
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    white = np.all(pixels == 255, axis=1)
    assert 0.02 < 1 - white.mean() < 0.9  # neither blank nor a solid error page
    # The charts' first series colour (#4e79a7) fills the bars.
    assert np.all(pixels == (0x4E, 0x79, 0xA7), axis=1).sum() > 2000
    # The thumbnails decoded: synthetic noisy images bring thousands of colours that text and
    # flat bars never do (a broken-image icon would bring a handful).
    assert len(np.unique(pixels, axis=0)) > 3000


def test_a_report_failure_fails_the_job_before_the_commit(dataset: Path, tmp_path: Path, spark,
                                                          monkeypatch: pytest.MonkeyPatch):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)

    def broken(root: str, info: dict) -> str:
        raise OSError(f"cannot write {root}/report.html: disk full")

    monkeypatch.setattr(shard_job, "write_report", broken)
    with pytest.raises(OSError, match="disk full"):
        shard_job.run(ShardConfig(dataset=str(copy), num_shards=2, image_size=24, image_format="png",
                                  max_reject_fraction=0.5, overwrite=True), SparkEngine(spark=spark))
    assert not (copy / "dataset.json").exists()  # never committed without its report
