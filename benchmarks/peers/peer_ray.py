"""Ray Data (``.venv-peers/ray``): Parquet files of the JPEG bytes and labels written by Ray Data's
``write_parquet`` (from ``read_binary_files``), read as its training-ingest guide recommends:
``read_parquet`` (file order shuffled), decoding in ``map_batches``, and
``iter_torch_batches(batch_size=64, local_shuffle_buffer_size=...)``, one pass of the lazy
dataset per epoch. Ray runs on this process's own local cluster of ``workers`` CPUs (started once
per process, on loopback, no dashboard). Remote: ``s3://...`` through the pyarrow S3 filesystem
pointed at the store's endpoint (``AWS_ENDPOINT_URL``), as Ray's docs do for an S3-compatible
store; no cache, every epoch reads every byte again. Ray's defaults are kept: its workers run at
nice 15, and each ``read_parquet`` pass reads the files' footers on 32 actors, each its own process
(``RAY_worker_niceness`` and ``RAY_DATA_PARQUET_FOOTER_NUM_ACTORS`` change them; the tests, which
run beside other work, set 0 and 2).

``build`` (the jobs benchmark): ``read_binary_files`` of the raw lake's files, ``map_batches`` of
``per_image.prepare`` on Ray tasks, ``write_parquet``, as Ray's batch-inference examples read,
transform and write images.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import ray
import torch
from build_cli import lake_images
from peer_common import Built, JpegSet, Settings, as_batch, decode, main

HERE = Path(__file__).resolve().parent
#: Rows shuffled together as batches are taken (WebDataset's buffer here is as many samples).
SHUFFLE_BUFFER = 1000


def _start(cpus: int) -> None:
    """Ray's local cluster for this process, once: ``cpus`` CPUs, on loopback, no dashboard.
    Its workers import the modules beside this one (``per_image``, ``peer_common``)."""
    if ray.is_initialized():
        return
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}},
        log_to_driver=False,
    )
    # No console progress bars: the other tools draw none on the cores being measured.
    ray.data.DataContext.get_current().enable_progress_bars = False


def _filesystem(source: str) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """Where Ray reads ``source``: a local folder, or ``s3://`` at ``AWS_ENDPOINT_URL``."""
    if not source.startswith("s3://"):
        return str(Path(source).resolve()), None
    endpoint = urlparse(os.environ["AWS_ENDPOINT_URL"])
    fs = pyarrow.fs.S3FileSystem(
        endpoint_override=endpoint.netloc,
        scheme=endpoint.scheme,
        access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        region=os.environ.get("AWS_REGION", "us-east-1"),
    )
    return source.removeprefix("s3://"), fs


# -- the writer ---------------------------------------------------------------------------------------
def _labelled(batch: pa.Table, labels: dict[str, int]) -> pa.Table:
    names = [Path(p).name for p in batch.column("path").to_pylist()]
    return pa.table(
        {"image": batch.column("bytes"), "label": pa.array([labels[n] for n in names], pa.int64())}
    )


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    _start(os.cpu_count() or 1)
    paths = [str(path) for path, _ in images.images]
    labels = {path.name: label for path, label in images.images}
    dataset = ray.data.read_binary_files(paths, include_paths=True)
    dataset.map_batches(_labelled, fn_kwargs={"labels": labels}, batch_format="pyarrow").write_parquet(
        str(out)
    )


# -- the jobs benchmark -----------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class _Span:
    """When the first and the last image's work finished (``time.time()``), over every task."""

    def __init__(self) -> None:
        self.first, self.last = float("inf"), float("-inf")

    def add(self, first: float, last: float) -> None:
        self.first, self.last = min(self.first, first), max(self.last, last)

    def get(self) -> tuple[float, float]:
        return self.first, self.last


def _prepared(batch: pa.Table, labels: dict[str, int], size: int, quality: int, span: Any) -> pa.Table:
    from per_image import prepare  # on Ray's workers, from PYTHONPATH (_start)

    paths = batch.column("path").to_pylist()
    images, done = [], []
    for data in batch.column("bytes").to_pylist():
        images.append(prepare(data, size, quality))
        done.append(time.time())
    if done:
        span.add.remote(done[0], done[-1])
    label = pa.array([labels[p] for p in paths], pa.int64())
    return pa.table({"path": paths, "label": label, "image": pa.array(images, pa.binary())})


def build(lake: Path, out: Path, *, size: int, quality: int, workers: int) -> Built:
    """The raw lake prepared on Ray tasks (``workers`` CPUs) and written by ``write_parquet``."""
    labels = {str(path.resolve()): label for path, label in lake_images(lake)}
    _start(workers)
    span = _Span.remote()
    dataset = ray.data.read_binary_files(list(labels), include_paths=True)
    dataset.map_batches(
        _prepared,
        fn_kwargs={"labels": labels, "size": size, "quality": quality, "span": span},
        batch_format="pyarrow",
    ).write_parquet(str(out))
    first, last = ray.get(span.get.remote())
    images = sum(pq.read_metadata(p).num_rows for p in out.glob("*.parquet"))
    return {"images": images, "first_done": first if images else None, "last_done": last if images else None}


def stored(out: Path) -> Iterator[tuple[int, bytes]]:
    for path in sorted(out.glob("*.parquet")):
        table = pq.read_table(path, columns=["label", "image"])
        yield from zip(table.column("label").to_pylist(), table.column("image").to_pylist())


# -- the loader ---------------------------------------------------------------------------------------
def _decoded(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"image": np.stack([decode(data) for data in batch["image"]]), "label": batch["label"]}


class Loader:
    def __init__(self, source: str, cache: Path | None, settings: Settings) -> None:
        _start(settings.workers)
        self.settings = settings
        path, filesystem = _filesystem(source)
        self.dataset = ray.data.read_parquet(path, filesystem=filesystem, shuffle="files").map_batches(
            _decoded, batch_format="numpy"
        )

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.dataset.iter_torch_batches(
            batch_size=self.settings.batch_size,
            local_shuffle_buffer_size=SHUFFLE_BUFFER,
            local_shuffle_seed=self.settings.seed + epoch,
        ):
            yield as_batch(batch["image"], batch["label"])


if __name__ == "__main__":
    sys.exit(main(None, write=write, open_loader=Loader, build=build, stored=stored))
