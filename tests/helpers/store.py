"""Stores for loader tests: the benchmarks' remote-like store (``benchmarks/remote_store.py``:
nginx behind a latency shim) where a test needs a store with its own request log or a slow link;
uploading a local dataset to a bucket (S3, GCS, Azure); waiting for a loader's reads to end, and for its
count of requests to meet the store's."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lakeshard import storage

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from remote_store import NginxMissingError, RemoteStore, find_nginx

__all__ = ["RemoteStore", "require_nginx", "settled_counts", "upload", "wait_reads_ended"]


def require_nginx() -> str:
    """nginx's path: a missing nginx fails the test (with how to install it), never skips it."""
    try:
        return find_nginx()
    except NginxMissingError as exc:
        pytest.fail(str(exc))


def upload(local: Path, bucket: str, prefix: str = "ds") -> str:
    """Copy the folder ``local`` to ``<bucket>/<prefix>`` (``bucket``: ``s3://name``, or another
    store's bucket, ``gs://name``, an Azure container ``az://name``); its URI."""
    import boto3

    if storage.scheme(bucket) != "s3":
        for p in sorted(local.rglob("*")):
            if p.is_file():
                storage.write_bytes_atomic(
                    f"{bucket}/{prefix}/{p.relative_to(local).as_posix()}", p.read_bytes()
                )
        return f"{bucket}/{prefix}"

    client = boto3.client("s3")
    name = bucket[len("s3://") :]
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.put_object(
                Bucket=name, Key=f"{prefix}/{p.relative_to(local).as_posix()}", Body=p.read_bytes()
            )
    return f"{bucket}/{prefix}"


def wait_reads_ended(loader: Any, timeout_s: float = 10.0) -> None:
    """Wait until no remote read of ``loader`` is in flight (its read-ahead of the next epoch)."""
    fetcher = loader.fetcher
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fetcher.reads_ended():
            return
        time.sleep(0.01)
    raise AssertionError("the loader's reads did not end")


def settled_counts(
    loader: Any, store: RemoteStore, first: Any, served: Any, timeout_s: float = 15.0
) -> tuple[Any, Any]:
    """The loader's store requests since ``first`` (its ``totals().store``) and ``store``'s traffic
    since ``served``, read when no read is in flight and both tell the same number of requests,
    or at the deadline (for the test to fail on). One look is not enough: the loader reads ahead
    while its threads fill the queue a test no longer consumes, and a decode thread that frees a
    piece admits the next read, so a look can fall between one read's end and the next one's
    start (the store then counts a read the snapshot of the loader did not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        wait_reads_ended(loader)
        if loader.cache is not None:
            loader.cache.wait(timeout=10)
        counted = loader.totals().store - first
        traffic = store.traffic() - served
        if counted.requests == traffic.gets or time.monotonic() > deadline:
            return counted, traffic
        time.sleep(0.05)
