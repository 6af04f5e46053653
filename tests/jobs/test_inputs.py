"""Both jobs check their inputs before an engine starts: a bad input is one ``prog: error: ...``
line and exit 2, and neither Spark nor Dask was imported, let alone started. And ``--overwrite``
with fewer ``--channels`` than the dataset has is refused, naming the channels it would delete."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.errors import ShardError
from lakeshard.format import shard_relpath
from tests.helpers.lake import write_lake

REPO = Path(__file__).resolve().parents[2]

#: Runs each (job, argv) through the job's main in one fresh interpreter; prints the exit codes
#: and which engine packages were imported by the end.
_PROBE = """
import json, sys
from jobs import manifest, shard
for job, argv in json.loads(sys.argv[1]):
    print("RC", {"manifest": manifest, "shard": shard}[job].main(argv), flush=True)
print("IMPORTED", json.dumps(sorted(m for m in ("pyspark", "distributed") if m in sys.modules)))
"""


@pytest.fixture()
def manifested(tmp_path: Path, local_engine) -> Path:
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 12, "b": 9})
    out = tmp_path / "ds"
    manifest_job.run(
        ManifestConfig(input=str(lake), output=str(out), split_method="stratified"), local_engine
    )
    return out


def test_bad_inputs_fail_before_any_engine_starts(manifested: Path, tmp_path: Path):
    ds = str(manifested)
    uncounted = tmp_path / "uncounted"  # a marker without the class counts the plan is made from
    shutil.copytree(manifested, uncounted)
    marker = json.loads((uncounted / "manifests" / "_manifest.json").read_text())
    del marker["counts"]["classes"]
    (uncounted / "manifests" / "_manifest.json").write_text(json.dumps(marker))
    cases = [
        (
            "shard",
            ["--engine", "spark", "--dataset", str(tmp_path / "nothing-here")],
            f"no complete manifest at file://{tmp_path / 'nothing-here'}",
        ),
        (
            "shard",
            ["--engine", "spark", "--dataset", ds, "--channels", "train,bogus"],
            "--channels names ['bogus'], which the manifest",
        ),
        (
            "shard",
            ["--engine", "dask", "--dataset", ds, "--channels", "train,train"],
            "--channels 'train,train' names 'train' more than once",
        ),
        ("shard", ["--engine", "dask", "--dataset", "ftp://host/ds"], "unsupported URI scheme 'ftp'"),
        (
            "shard",
            ["--engine", "spark", "--dataset", str(uncounted)],
            "has no class counts (counts.classes) for channel(s) ['test', 'train', 'validation']; run jobs/manifest.py again",
        ),
        (
            "manifest",
            ["--engine", "spark", "--input", "ftp://host/raw", "--output", str(tmp_path / "o")],
            "unsupported URI scheme 'ftp'",
        ),
        (
            "manifest",
            ["--engine", "dask", "--input", str(tmp_path / "no-lake"), "--output", str(tmp_path / "o")],
            f"--input {str(tmp_path / 'no-lake')!r}: file://{tmp_path / 'no-lake'} does not exist",
        ),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([(job, argv) for job, argv, _ in cases])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("RC ")]
    assert codes == [2] * len(cases), proc.stdout + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == len(cases), proc.stderr[-3000:]
    for (job, _, message), line in zip(cases, errors, strict=True):
        assert line.startswith(f"jobs/{job}.py: error: ") and message in line, (message, line)
    assert "Traceback" not in proc.stderr
    imported = json.loads(proc.stdout.rsplit("IMPORTED ", 1)[1])
    assert imported == [], f"an engine was imported before the inputs were checked: {imported}"


def test_overwriting_a_subset_of_channels_is_refused_naming_the_others(manifested: Path, local_engine):
    first = shard_job.run(ShardConfig(dataset=str(manifested), num_shards=1, image_size=16), local_engine)
    assert set(first.channels) == {"train", "validation", "test"}
    before = (manifested / "dataset.json").read_bytes()
    with pytest.raises(ShardError, match=r"would delete the shards of channel\(s\) \['test', 'validation'\]"):
        shard_job.run(
            ShardConfig(
                dataset=str(manifested), num_shards=1, image_size=16, channels="train", overwrite=True
            ),
            local_engine,
        )
    assert (manifested / "dataset.json").read_bytes() == before
    assert (manifested / shard_relpath("validation", 0, 1)).exists()
    # Every channel the dataset has, named explicitly, is a rebuild like any other.
    again = shard_job.run(
        ShardConfig(
            dataset=str(manifested),
            num_shards=1,
            image_size=16,
            channels="train,validation,test",
            overwrite=True,
        ),
        local_engine,
    )
    assert set(again.channels) == {"train", "validation", "test"}
    assert "--channels naming fewer channels" in shard_job.parser().format_help().replace("\n", " ").replace(
        "  ", " "
    )
