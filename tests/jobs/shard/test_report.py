"""report.html: written by the shard job after dataset.json (a failure there is a warning, not a
failed job), rewritten by ``python -m jobs.report``, self-contained, bounded in what it reads, and
rendered by a real (headless) Chromium with its charts and thumbnails."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines.local_engine import LocalEngine
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.report_html import render_report, write_report
from lakeshard.format import read_dataset_info, read_manifest_info, shard_rejects_uri
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import read_table, shard_tables
from tests.helpers.datasets import build_dataset_with_rejects
from tests.helpers.edge_lake import HIDDEN, write_edge_lake
from tests.helpers.lake import write_lake

REPO = Path(__file__).resolve().parents[3]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SAMPLES_PER_CLASS = 6  # write_report's default


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three classes, one object the manifest job rejects and one the shard job rejects."""
    return build_dataset_with_rejects(
        LocalEngine(workers=2), tmp_path_factory.mktemp("report"), {"cat": 24, "dog": 18, "fox": 10}, seed=3
    )


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
    assert report.stat().st_mtime_ns >= dataset_json.stat().st_mtime_ns  # after the commit
    info = read_dataset_info(str(dataset))
    html = report.read_text()
    tags = _tags(html)
    names = [t for t, _ in tags]

    # Self-contained: nothing fetched, nothing run.
    assert "script" not in names and "link" not in names
    assert not [
        a for _, a in tags for k in ("src", "href") if (a.get(k) or "").startswith(("http:", "https:", "//"))
    ]

    # Charts: class counts, splits, rejects, shard balance, each an inline SVG with bars.
    assert names.count("svg") == 4
    assert names.count("rect") >= 3 * 3 + 3 * 2 + 2 + 3 * 2

    # Thumbnails: the shards' own bytes as data URIs, up to SAMPLES_PER_CLASS per class of train.
    train = shard_tables(str(dataset), "train", 2)
    train_images = {b for t in train for b in t["image"].to_pylist()}
    train_labels = [label for t in train for label in t["label"].to_pylist()]
    srcs = [a["src"] for t, a in tags if t == "img"]
    expected = sum(min(SAMPLES_PER_CLASS, train_labels.count(i)) for i in info.labels.values())
    assert len(srcs) == expected > 0
    for src in srcs:
        head, _, payload = src.partition(",")
        assert head == "data:image/png;base64"
        data = base64.b64decode(payload)
        assert data in train_images
        assert Image.open(io.BytesIO(data)).size == (24, 24)

    # Counts, rejects with their reasons, lineage.
    manifest_rejects = read_channel(str(dataset), "rejects")
    shard_rejects = read_table(shard_rejects_uri(str(dataset)))
    assert manifest_rejects.num_rows == 1 and shard_rejects.num_rows == 1
    for reason in manifest_rejects["reason"].to_pylist() + shard_rejects["reason"].to_pylist():
        assert reason.split(":", 1)[0] in html
    assert "cat/notes.jpg" in html and "dog/broken.jpg" in html
    assert "Rejects (2)" in html
    assert f"<td>{info.counts.listed}</td>" in html
    for value in (info.dataset_version, info.inputs.manifest_fingerprint, info.versions["pyarrow"]):
        assert str(value) in html
    for channel, entry in info.channels.items():
        assert f"rows per shard: [{entry.rows_per_shard}]" in html
        assert f"<td>{channel}</td>" in html


def test_cli_rewrites_the_same_report(dataset: Path, tmp_path: Path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    original = (copy / "report.html").read_bytes()
    (copy / "report.html").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.report", str(copy)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "report.html" in proc.stdout
    rewritten = (copy / "report.html").read_bytes()
    assert rewritten.replace(str(copy).encode(), b"") == original.replace(str(dataset).encode(), b"")

    help_ = subprocess.run(
        [sys.executable, "-m", "jobs.report", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert help_.returncode == 0 and "dataset.json" in help_.stdout

    (copy / "dataset.json").unlink()
    missing = subprocess.run(
        [sys.executable, "-m", "jobs.report", str(copy)], cwd=REPO, capture_output=True, text=True
    )
    assert missing.returncode == 2
    assert "dataset.json does not exist" in missing.stderr and str(copy) in missing.stderr


#: A bound far above any run seen (a screenshot once took over 120 s on a loaded 2-core machine);
#: the tests wait on what Chromium does (its exit, the screenshot written whole), not on a clock.
_CHROMIUM_BOUND_S = 900


def _chromium(*args: str, user_data: Path, wrote: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium until it exits, or, with ``wrote``, until it has written that PNG
    whole (a headless Chromium may linger after its screenshot: then it is killed, and its
    return code is of no interest)."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup_test_extras.sh (or set CHROMIUM)")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={user_data}",
        "--run-all-compositor-stages-before-draw",
        "--virtual-time-budget=5000",
        *args,
    ]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True)
        deadline = time.monotonic() + _CHROMIUM_BOUND_S
        try:
            while proc.poll() is None and not (wrote is not None and _whole_png(wrote)):
                assert time.monotonic() < deadline, f"Chromium ran {_CHROMIUM_BOUND_S} s: {cmd}"
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(timeout=60)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def _whole_png(path: Path) -> bool:
    """Whether ``path`` is a PNG written to its end (its last chunk, IEND, is there)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    return data.startswith(b"\x89PNG") and data[-12:-4] == b"\x00\x00\x00\x00IEND"


@pytest.mark.slow
def test_report_renders_in_chromium(dataset: Path, tmp_path: Path):
    url = (dataset / "report.html").resolve().as_uri()
    dom = _chromium("--dump-dom", url, user_data=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    tags = _tags(dom.stdout)
    assert [t for t, _ in tags].count("svg") == 4
    assert sum(1 for t, a in tags if t == "img" and (a.get("src") or "").startswith("data:image/png")) > 0

    shot = tmp_path / "report.png"
    proc = _chromium(
        f"--screenshot={shot}",
        "--window-size=1200,3000",
        url,
        user_data=tmp_path / "profile-shot",
        wrote=shot,
    )
    assert _whole_png(shot), proc.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    white = np.all(pixels == 255, axis=1)
    assert 0.02 < 1 - white.mean() < 0.9  # neither blank nor a solid error page
    # The charts' first series colour (#4e79a7) fills the bars.
    assert np.all(pixels == (0x4E, 0x79, 0xA7), axis=1).sum() > 2000
    # The thumbnails decoded: synthetic noisy images bring thousands of colours that text and
    # flat bars never do (a broken-image icon would bring a handful).
    assert len(np.unique(pixels, axis=0)) > 3000


def test_a_report_that_cannot_be_written_is_a_warning_and_the_dataset_is_committed(
    dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    (copy / "report.html").unlink()
    (copy / "report.html").mkdir()  # the report's target cannot be replaced by a file
    (copy / "report.html" / "keep").write_text("a folder in the way")
    with caplog.at_level("WARNING", logger="jobs.shard"):
        rc = shard_job.main(
            [
                "--engine",
                "local",
                "--dataset",
                str(copy),
                "--num-shards",
                "2",
                "--image-size",
                "24",
                "--image-format",
                "png",
                "--max-reject-fraction",
                "0.5",
                "--overwrite",
            ]
        )
    assert rc == 0
    info = read_dataset_info(str(copy))  # committed
    assert info.dataset_version == read_dataset_info(str(dataset)).dataset_version
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("report could not be written" in w and "report.html" in w for w in warnings), warnings


def test_the_report_reads_a_few_row_groups_whatever_the_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A class with one train row can never fill its row of thumbnails: the report must not scan
    # every row group of every shard looking for more.
    lake = tmp_path / "raw"
    write_lake(lake, {"many": 121, "one": 1}, size=(40, 32))
    out = tmp_path / "ds"
    engine = LocalEngine(workers=2)
    manifest_job.run(ManifestConfig(input=str(lake), output=str(out), split="train=1"), engine)
    info = shard_job.run(
        ShardConfig(dataset=str(out), num_shards=2, image_size=24, image_format="png", row_group_size="4KiB"),
        engine,
    )
    row_groups = sum(s.row_groups for s in info.channels["train"].shards)
    assert info.channels["train"].class_counts["one"] == 1 and row_groups >= 25

    reads = []
    real = pq.ParquetFile.read_row_group

    def counted(self: pq.ParquetFile, i: int, *args, **kwargs):
        reads.append(i)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    write_report(str(out), info)
    html = (out / "report.html").read_text()
    assert 0 < len(reads) <= 8 and len(reads) * 5 <= row_groups, (len(reads), row_groups)
    assert html.count("<img class='thumb' alt='many'") == SAMPLES_PER_CLASS


def test_the_report_shows_what_was_skipped_and_the_duplicates_across_channels(tmp_path: Path, local_engine):
    """Hidden files are counted as skipped and identical images across channels are flagged as
    leakage, from the manifest job's summary of a real run (the in-process engine)."""
    lake = write_edge_lake(tmp_path)
    out = tmp_path / "ds"
    manifest_job.run(
        ManifestConfig(
            input=str(lake),
            output=str(out),
            seed=3,
            max_reject_fraction=0.5,
            split={"train": 0.5, "validation": 0.25, "test": 0.25},
        ),
        local_engine,
    )
    info = shard_job.run(
        ShardConfig(dataset=str(out), num_shards=1, image_size=16, remainder="pad"), local_engine
    )
    marker = read_manifest_info(str(out))
    dups = marker.duplicates
    assert marker.counts.skipped == len(HIDDEN) and dups and dups.across_channels >= 1
    page = render_report(str(out), info)
    section = page[page.index("The lake: skipped objects and duplicates") :]
    assert f"{len(HIDDEN)} objects skipped, not rejected" in section
    assert f"<b>Leakage:</b> {dups.across_channels} set(s)" in section
    for group in dups.examples:
        for key in group:
            assert key in section
