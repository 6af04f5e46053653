"""The dataset lock (:mod:`lakeshard.locks`): held by another process, it refuses with the
holder named; shared holders coexist; a process may take its own lock again. On S3 (a real moto
server) and Azure (Azurite) the lock is a conditionally created object: a second holder is refused naming the first,
a killed holder's lock is taken over once it expires, and a holder whose lock was taken over
commits nothing."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from lakeshard import storage
from lakeshard.locks import LOCK_NAME, DatasetBusyError, confirm, dataset_lock
from tests.helpers.locks import held_elsewhere


def test_an_exclusive_holder_is_named_and_released_with_its_process(tmp_path: Path):
    with held_elsewhere(tmp_path, exclusive=True) as holder:
        for exclusive in (True, False):
            with pytest.raises(DatasetBusyError) as err:
                with dataset_lock(str(tmp_path), job="mine", exclusive=exclusive):
                    pass
            assert f"file://{tmp_path} is busy: test job is writing it since " in str(err.value)
            assert f"pid {holder.pid} on " in str(err.value)
    assert (tmp_path / LOCK_NAME).read_text() == ""  # emptied by its holder
    with dataset_lock(str(tmp_path), job="mine"):
        assert '"job": "mine"' in (tmp_path / LOCK_NAME).read_text()


def test_shared_holders_coexist_and_keep_a_writer_out(tmp_path: Path):
    with held_elsewhere(tmp_path, exclusive=False):
        with dataset_lock(str(tmp_path), job="plan", exclusive=False):
            pass
        with pytest.raises(DatasetBusyError, match="another job is reading it"):
            with dataset_lock(str(tmp_path), job="shard"):
                pass


def test_a_process_takes_its_own_lock_again(tmp_path: Path):
    with dataset_lock(str(tmp_path), job="shard"):
        with dataset_lock(str(tmp_path), job="shard"):
            pass
        assert '"job": "shard"' in (tmp_path / LOCK_NAME).read_text()  # still held after the inner release
    assert (tmp_path / LOCK_NAME).read_text() == ""


def test_s3_plan_only_takes_no_lock():
    with dataset_lock("s3://bucket/ds", job="plan", exclusive=False):  # no request: no bucket needed
        pass


def _lock_object(ds: str) -> dict | None:
    try:
        return json.loads(storage.read_bytes(f"{ds}/{LOCK_NAME}"))
    except Exception:
        return None


@pytest.fixture(
    params=[pytest.param("s3", marks=pytest.mark.s3), pytest.param("az", marks=pytest.mark.azure)]
)
def remote(request: pytest.FixtureRequest) -> str:
    """A fresh bucket of each object store with conditional writes (S3, Azure), as a URI."""
    return str(request.getfixturevalue("s3_bucket" if request.param == "s3" else "az_container"))


def test_s3_a_second_holder_is_refused_naming_the_first(remote: str):
    ds = f"{remote}/ds"
    with held_elsewhere(ds, exclusive=True) as holder:
        with pytest.raises(DatasetBusyError) as err:
            with dataset_lock(ds, job="mine"):
                pass
        assert f"{ds} is busy: test job is writing it since " in str(err.value)
        assert f"pid {holder.pid} on " in str(err.value)
        assert "\n" not in str(err.value)
    assert _lock_object(ds) is None  # its holder deleted it
    with dataset_lock(ds, job="mine"):
        assert _lock_object(ds)["job"] == "mine"
    assert _lock_object(ds) is None


def _store_age(uri: str) -> float:
    """Seconds since the object was written, by the store's clock."""
    import email.utils

    import boto3

    bucket, _, key = storage.store_for(uri).path(uri).partition("/")
    resp = boto3.client("s3").head_object(Bucket=bucket, Key=key)
    now = email.utils.parsedate_to_datetime(resp["ResponseMetadata"]["HTTPHeaders"]["date"])
    return (now - resp["LastModified"]).total_seconds()


@pytest.mark.slow  # waits out a lock's refresh or expiry
def test_s3_a_holder_refreshes_its_lock_and_each_refresh_is_another_object(s3_bucket: str):
    import boto3

    ds = f"{s3_bucket}/ds"
    bucket, _, key = storage.filesystem(f"{ds}/{LOCK_NAME}")[1].partition("/")
    client = boto3.client("s3")
    with held_elsewhere(ds, exclusive=True, expiry=4):  # a refresh every second
        first = client.head_object(Bucket=bucket, Key=key)
        deadline = time.monotonic() + 120
        while (now := client.head_object(Bucket=bucket, Key=key))["ETag"] == first["ETag"]:
            assert time.monotonic() < deadline, "the holder never refreshed its lock"
            time.sleep(0.2)
        assert now["LastModified"] >= first["LastModified"]
        assert "refreshed" in _lock_object(ds)
    assert _lock_object(ds) is None


def test_s3_a_lock_left_by_a_job_killed_on_this_host_is_taken_over_at_once(remote: str, caplog):
    ds = f"{remote}/ds"
    with held_elsewhere(ds, exclusive=True) as holder:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert _lock_object(ds)["pid"] == holder.pid  # a killed holder leaves its lock
    with dataset_lock(ds, job="mine"):
        assert _lock_object(ds)["job"] == "mine"
    assert "taking over the lock of a job that died on this host" in caplog.text


@pytest.mark.slow  # waits out a lock's refresh or expiry
def test_s3_a_lock_left_by_a_job_elsewhere_is_taken_over_once_it_expires(s3_bucket: str, caplog):
    import boto3

    ds = f"{s3_bucket}/ds"
    bucket, _, key = storage.filesystem(f"{ds}/{LOCK_NAME}")[1].partition("/")
    left = {"job": "shard", "pid": 4242, "host": "another-host", "since": "then", "expires_after_s": 20}
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=json.dumps(left).encode())
    if _store_age(f"{ds}/{LOCK_NAME}") < 10:  # a stalled test machine may take longer to get here
        with pytest.raises(
            DatasetBusyError, match=r"shard job is writing it .*expires 20 s after its last refresh"
        ):
            with dataset_lock(ds, job="mine"):
                pass
    deadline = time.monotonic() + 120
    while _store_age(f"{ds}/{LOCK_NAME}") <= 20.5:  # the store's clock, as the lock reads it
        assert time.monotonic() < deadline, "the store's clock did not pass the lock's expiry"
        time.sleep(0.5)
    with dataset_lock(ds, job="mine"):
        assert _lock_object(ds)["job"] == "mine"
    assert "taking over the lock of a job that stopped refreshing it" in caplog.text


def test_s3_a_holder_whose_lock_was_taken_over_commits_nothing(remote: str):
    ds = f"{remote}/ds"
    with dataset_lock(ds, job="mine"):
        confirm(ds)  # still ours
        other = json.dumps({"job": "other", "pid": 1, "host": "h", "since": "now", "command": "c"}).encode()
        storage.write_bytes_atomic(f"{ds}/{LOCK_NAME}", other)  # another job took it over
        with pytest.raises(DatasetBusyError, match="another job took this job's lock over"):
            confirm(ds)
    assert _lock_object(ds)["job"] == "other"  # the release left the other job's lock alone


@pytest.mark.slow  # waits out a lock's refresh or expiry
def test_s3_a_lock_the_store_cannot_delete_at_the_end_is_a_warning(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch, caplog
):
    ds = f"{s3_bucket}/ds"
    with dataset_lock(ds, job="mine"):
        done = True
        # the store goes away before the job ends (nothing listens on port 9, the discard port)
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert done
    assert f"cannot delete the lock {ds}/{LOCK_NAME} (it expires in 60 s)" in caplog.text
    monkeypatch.undo()
    assert _lock_object(ds)["job"] == "mine"  # left to expire
