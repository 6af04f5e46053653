"""lakeshard.storage's atomic writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lakeshard import storage


@pytest.mark.parametrize("durable", [True, False])
def test_an_atomic_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path, durable: bool):
    """``durable=False`` (a job's scratch files) skips only the fsync: the file is still
    written under a temporary name and renamed onto the old one."""
    target = tmp_path / "d" / "f.parquet"
    storage.write_bytes_atomic(str(target), b"old", durable=durable)
    storage.write_bytes_atomic(str(target), b"new bytes", durable=durable)
    assert target.read_bytes() == b"new bytes"
    assert [p.name for p in target.parent.iterdir()] == ["f.parquet"]
