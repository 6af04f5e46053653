"""GCS (the emulator of tests/conftest.py): the emulator's test-side extension answers the JSON
API's generation preconditions, suffix ranges and listing pages as Google documents them (what
the store's lock, footers and the balanced listing rely on, and the bare emulator ignores); the
dataset lock on GCS refuses a second holder and a holder whose lock was taken over commits
nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from lakeshard import storage
from lakeshard.locks import LOCK_NAME, DatasetBusyError, confirm, dataset_lock
from tests.helpers.locks import held_elsewhere

pytestmark = pytest.mark.gcs


def _upload(endpoint: str, bucket: str, name: str, data: bytes, **params: Any) -> requests.Response:
    return requests.post(
        f"{endpoint}/upload/storage/v1/b/{bucket}/o",
        params={"uploadType": "media", "name": name, **params},
        data=data,
        timeout=30,
    )


def _download(endpoint: str, bucket: str, name: str, **kwargs: Any) -> requests.Response:
    return requests.get(
        f"{endpoint}/download/storage/v1/b/{bucket}/o/{name}",
        params={"alt": "media", **kwargs.pop("params", {})},
        timeout=30,
        **kwargs,
    )


def test_the_emulator_answers_generation_preconditions_as_gcs_documents(gcs_emulator: Any, gcs_bucket: str):
    """https://cloud.google.com/storage/docs/request-preconditions: ``ifGenerationMatch=0`` only
    creates; a generation that is not the live one's is 412 conditionNotMet, for an upload, a
    download and a delete; the bare emulator would have written, read and deleted."""
    endpoint, bucket = gcs_emulator.endpoint, gcs_bucket[len("gs://") :]
    created = _upload(endpoint, bucket, "k", b"one", ifGenerationMatch=0)
    assert created.status_code == 200
    first = created.json()["generation"]
    refused = _upload(endpoint, bucket, "k", b"two", ifGenerationMatch=0)
    assert refused.status_code == 412 and refused.json()["error"]["errors"][0]["reason"] == "conditionNotMet"
    assert _upload(endpoint, bucket, "k", b"two", ifGenerationMatch=int(first) + 1).status_code == 412
    assert _download(endpoint, bucket, "k").content == b"one"
    replaced = _upload(endpoint, bucket, "k", b"three", ifGenerationMatch=first)
    second = replaced.json()["generation"]
    assert replaced.status_code == 200 and second != first
    assert _download(endpoint, bucket, "k", params={"ifGenerationMatch": first}).status_code == 412
    got = _download(endpoint, bucket, "k", params={"ifGenerationMatch": second})
    assert got.content == b"three" and got.headers["x-goog-generation"] == second
    assert "Last-Modified" in got.headers
    assert _upload(endpoint, bucket, "new", b"x", ifGenerationMatch=second).status_code == 412  # none live
    delete = f"{endpoint}/storage/v1/b/{bucket}/o/k"
    assert requests.delete(delete, params={"ifGenerationMatch": first}, timeout=30).status_code == 412
    assert requests.delete(delete, params={"ifGenerationMatch": second}, timeout=30).status_code in (200, 204)
    assert requests.delete(delete, params={"ifGenerationMatch": second}, timeout=30).status_code == 404
    assert _upload(endpoint, bucket, "k", b"four").status_code == 200  # no precondition: a plain write


def test_the_emulator_answers_a_suffix_range_with_the_last_bytes(gcs_emulator: Any, gcs_bucket: str):
    endpoint, bucket = gcs_emulator.endpoint, gcs_bucket[len("gs://") :]
    data = bytes(range(200))
    assert _upload(endpoint, bucket, "r", data).status_code == 200
    tail = _download(endpoint, bucket, "r", headers={"Range": "bytes=-30"})
    assert tail.status_code == 206 and tail.content == data[-30:]
    assert tail.headers["Content-Range"] == "bytes 170-199/200"
    whole = _download(endpoint, bucket, "r", headers={"Range": "bytes=-1000"})
    assert whole.content == data and whole.headers["Content-Range"] == "bytes 0-199/200"
    assert _download(endpoint, bucket, "r", headers={"Range": "bytes=10-19"}).content == data[10:20]
    assert _download(endpoint, bucket, "missing", headers={"Range": "bytes=-5"}).status_code == 404


def test_the_emulator_answers_listing_offsets_and_pages_as_gcs_documents(gcs_emulator: Any, gcs_bucket: str):
    """https://cloud.google.com/storage/docs/json_api/v1/objects/list: ``startOffset`` includes
    the name it gives, ``endOffset`` excludes it; ``maxResults`` entries a page, the next page by
    ``nextPageToken``; the bare emulator answers every object in one page."""
    endpoint, bucket = gcs_emulator.endpoint, gcs_bucket[len("gs://") :]
    for name in ("c/a", "c/a0", "c/a0/x", "c/b", "c/c", "d/a"):
        assert _upload(endpoint, bucket, name, b"x").status_code == 200

    def names(**params: Any) -> tuple[list[str], str | None]:
        got = requests.get(f"{endpoint}/storage/v1/b/{bucket}/o", params=params, timeout=30)
        assert got.status_code == 200, got.text
        return [i["name"] for i in got.json()["items"]], got.json().get("nextPageToken")

    assert names(prefix="c/", startOffset="c/a0", endOffset="c/c") == (["c/a0", "c/a0/x", "c/b"], None)
    first, token = names(prefix="c/", startOffset="c/a0", maxResults=2)
    assert first == ["c/a0", "c/a0/x"] and token
    assert names(prefix="c/", startOffset="c/a0", maxResults=2, pageToken=token) == (["c/b", "c/c"], None)


def _lock_object(ds: str) -> dict[str, Any] | None:
    uri = f"{ds}/{LOCK_NAME}"
    return dict(json.loads(storage.read_bytes(uri))) if storage.exists(uri) else None


def test_gcs_a_second_holder_is_refused_naming_the_first(gcs_bucket: str):
    ds = f"{gcs_bucket}/ds"
    with held_elsewhere(ds, exclusive=True) as holder:
        with pytest.raises(DatasetBusyError) as err:
            with dataset_lock(ds, job="mine"):
                pass
        assert f"{ds} is busy: test job is writing it since " in str(err.value)
        assert f"pid {holder.pid} on " in str(err.value)
    assert _lock_object(ds) is None  # its holder deleted it
    with dataset_lock(ds, job="mine"):
        assert (_lock_object(ds) or {})["job"] == "mine"
    assert _lock_object(ds) is None


def test_gcs_a_holder_whose_lock_was_taken_over_commits_nothing(gcs_bucket: str):
    ds = f"{gcs_bucket}/ds"
    with dataset_lock(ds, job="mine"):
        confirm(ds)  # still ours
        other = {"job": "other", "pid": 1, "host": "h", "since": "now", "command": "c"}
        storage.write_bytes_atomic(f"{ds}/{LOCK_NAME}", json.dumps(other).encode())  # taken over
        with pytest.raises(DatasetBusyError, match="another job took this job's lock over"):
            confirm(ds)
    assert (_lock_object(ds) or {})["job"] == "other"  # the release left the other job's lock alone
