"""Issue 35: a class missing from a channel. With ``--min-per-class`` 1 (the default) the error
says what works (``--min-per-class 0``), not to lower a value that cannot go lower; with 0 the
manifest is written, and the shard job and the loader handle the channel that lacks the class."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from lakeshard.errors import SplitError
from lakeshard.format import read_manifest_info
from loaders.shard_loader import ShardLoader
from tests.helpers.lake import write_lake

#: The stratified split of 3 objects at 80/10/10 gives train all three: "tiny" has no
#: validation nor test object.
COUNTS = {"big": 30, "mid": 12, "tiny": 3}


def _manifest_main(lake, out, *extra: str) -> int:
    """``jobs.manifest`` on the local engine, as a user types it."""
    return manifest_job.main(["--engine", "local", "--input", str(lake), "--output", str(out), *extra])


def test_a_class_missing_from_a_channel_names_min_per_class_0(tmp_path: Path, capsys) -> None:
    write_lake(tmp_path / "lake", COUNTS)
    code = _manifest_main(str(tmp_path / "lake"), str(tmp_path / "ds"), "--split-method", "stratified")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert "'tiny' (train=3, validation=0, test=0)" in err
    assert "--min-per-class 0" in err and "lower --min-per-class" not in err


def test_a_higher_minimum_still_says_lower_it(tmp_path: Path, local_engine) -> None:
    write_lake(tmp_path / "lake", COUNTS)
    cfg = manifest_job.ManifestConfig(
        input=str(tmp_path / "lake"),
        output=str(tmp_path / "ds"),
        engine="local",
        split_method="stratified",
        min_per_class=2,
    )
    with pytest.raises(SplitError, match=r"lower --min-per-class \(now 2; 0 lets a class be missing"):
        manifest_job.run(cfg, local_engine)


@pytest.mark.slow
def test_min_per_class_0_builds_a_dataset_whose_channel_lacks_a_class(tmp_path: Path, capsys) -> None:
    """Manifest and shard job through their command lines (``--engine local``), then the loader
    reads each channel: validation and test hold no "tiny" row and are read whole."""
    write_lake(tmp_path / "lake", COUNTS)
    out = str(tmp_path / "ds")
    assert (
        _manifest_main(str(tmp_path / "lake"), out, "--split-method", "stratified", "--min-per-class", "0")
        == 0
    ), capsys.readouterr().err
    marker = read_manifest_info(out)
    assert marker.min_per_class == 0
    assert {c: marker.counts.classes[c]["tiny"] for c in ("train", "validation", "test")} == {
        "train": 3,
        "validation": 0,
        "test": 0,
    }
    assert (
        shard_job.main(
            [
                "--engine",
                "local",
                "--dataset",
                out,
                "--num-shards",
                "2",
                "--image-size",
                "16",
                "--remainder",
                "pad",
            ]
        )
        == 0
    ), capsys.readouterr().err
    tiny = marker.labels["tiny"]
    for channel in ("validation", "test", "train"):
        seen: Counter[int] = Counter()
        for _, labels in ShardLoader(out, channel=channel, batch_size=2, num_threads=1, drop_last=False):
            seen.update(labels.tolist())
        want = {marker.labels[name]: n for name, n in marker.counts.classes[channel].items() if n}
        assert {k: v for k, v in seen.items() if k >= 0} == want, channel
        assert (tiny in seen) == (channel == "train")
