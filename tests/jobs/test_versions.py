"""``python -m jobs.versions``: its command line, its errors, and the commands the docs show.
What it does to versions on S3 is tested where the versions are made, in
tests/hardening/test_s3_versions.py."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import versions

ROOT = Path(__file__).resolve().parents[2]


def _doc_commands() -> list[list[str]]:
    found = []
    for doc in [ROOT / "docs" / "jobs.md", ROOT / "jobs" / "versions.py"]:
        for line in doc.read_text(encoding="utf-8").splitlines():
            if m := re.match(r"\s*python -m jobs\.versions (.*)$", line):
                found.append(shlex.split(m.group(1)))
    return found


def test_the_commands_the_docs_show_parse():
    commands = _doc_commands()
    assert {c[0] for c in commands} == {"list", "remove"}, commands
    for argv in commands:
        args = versions.parser().parse_args(argv)
        assert args.dataset.startswith("s3://"), argv


def test_help_names_both_commands():
    out = subprocess.run(
        [sys.executable, "-m", "jobs.versions", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    assert "{list,remove}" in out and "never removed" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["remove", "--dataset", "x", "--keep", "1", "--version", "v"], "not allowed with argument"),
        (["remove", "--dataset", "x"], "one of the arguments --keep --version is required"),
        (["remove", "--dataset", "x", "--keep", "two"], "invalid int value: 'two'"),
        (["list"], "the following arguments are required: --dataset"),
    ],
)
def test_a_bad_command_line_is_refused_by_argparse(argv: list[str], message: str, capsys):
    with pytest.raises(SystemExit) as exit_:
        versions.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_values_are_one_error_line_naming_them(tmp_path: Path, capsys):
    root = str(tmp_path / "ds")
    (tmp_path / "ds" / "manifests").mkdir(parents=True)  # a dataset with no shards yet
    for argv, message in [
        (
            ["remove", "--dataset", root, "--keep", "0"],
            "--keep must be an integer >= 1 (the current version is always kept), got 0",
        ),
        (["remove", "--dataset", root, "--version", "../up"], "--version: a shard version must match"),
        (
            ["remove", "--dataset", root, "--version", "0123456789abcdef-01234567"],
            "has no such version (it has none",
        ),
        (["list", "--dataset", "ftp://host/ds"], "unsupported URI scheme 'ftp'"),
    ]:
        assert versions.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.fullmatch(r"jobs/versions.py: error: [^\n]+\n", err), err
        assert message in err, (argv, err)


def test_a_local_dataset_has_no_version_folders(tmp_path: Path, capsys):
    (tmp_path / "ds" / "shards" / "channel=train").mkdir(parents=True)
    assert versions.main(["list", "--dataset", str(tmp_path / "ds")]) == 0
    assert capsys.readouterr().out == f"file://{tmp_path}/ds has no version folders\n"
    assert versions.main(["remove", "--dataset", str(tmp_path / "ds"), "--keep", "1"]) == 0
    assert capsys.readouterr().out == "nothing to remove\n"
    assert (tmp_path / "ds" / "shards" / "channel=train").is_dir()
