"""Mosaic Streaming: MDS shards written by ``streaming.MDSWriter`` (its default 64 MiB
``size_limit``, no compression: JPEGs do not compress), read by ``streaming.StreamingDataset``
(shuffled, its default ``py1e`` algorithm, ``batch_size`` given so it partitions by batch) in
``workers`` processes of a torch DataLoader, as its docs recommend. Remote: ``remote=s3://...``
through its boto3 downloader (``S3_ENDPOINT_URL``), whole shards copied into ``local``, a fresh
cache folder per run; local: ``local=`` the written folder, no remote.

Build (the jobs benchmark): ``workers`` processes, each doing the per-image work of its share of
the lake and writing it with its own ``MDSWriter`` into a subfolder, then
``streaming.base.util.merge_index`` writes the one index over them: Streaming's documented way to
write in parallel.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from build_cli import lake_images
from peer_common import Built, JpegSet, Settings, collate, decode, main
from per_image import prepare
from streaming import MDSWriter, StreamingDataset
from streaming.base.util import clean_stale_shared_memory, merge_index

COLUMNS = {"image": "bytes", "label": "int"}


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    with MDSWriter(out=str(out), columns=COLUMNS) as sink:
        for path, label in images.images:
            sink.write({"image": path.read_bytes(), "label": label})


def _write_part(job: tuple[str, list[tuple[str, int]], int, int]) -> tuple[int, float | None, float | None]:
    """One writer process: its share of the lake into its own subfolder; (images, first and
    last ``time.time()`` an image's work finished)."""
    folder, share, size, quality = job
    first = last = None
    with MDSWriter(out=folder, columns=COLUMNS) as sink:
        for path, label in share:
            sink.write({"image": prepare(Path(path).read_bytes(), size, quality), "label": label})
            last = time.time()
            first = first or last
    return len(share), first, last


def build(lake: Path, out: Path, *, size: int, quality: int, workers: int) -> Built:
    images = [(str(path), label) for path, label in lake_images(lake)]
    jobs = [(str(out / f"part-{w:03d}"), images[w::workers], size, quality) for w in range(workers)]
    with multiprocessing.Pool(workers) as pool:
        parts = pool.map(_write_part, jobs)
    merge_index(str(out), keep_local=True)
    firsts = [p[1] for p in parts if p[1] is not None]
    lasts = [p[2] for p in parts if p[2] is not None]
    return {
        "images": sum(p[0] for p in parts),
        "first_done": min(firsts, default=None),
        "last_done": max(lasts, default=None),
    }


def stored(out: Path) -> Iterator[tuple[int, bytes]]:
    clean_stale_shared_memory()
    dataset = StreamingDataset(local=str(out), shuffle=False, batch_size=1)
    for i in range(dataset.num_samples):
        sample = dataset[i]
        yield int(sample["label"]), sample["image"]


class Images(StreamingDataset):
    def __getitem__(self, index: int) -> tuple[Any, int]:
        sample = super().__getitem__(index)
        return decode(sample["image"]), int(sample["label"])


class Loader:
    def __init__(self, source: str, cache: Path | None, settings: Settings) -> None:
        clean_stale_shared_memory()  # what an earlier run killed mid-epoch left in /dev/shm
        where: dict[str, str] = {"local": source}
        if source.startswith("s3://"):
            assert cache is not None, "Streaming reads a remote through its local cache"
            where = {"remote": source, "local": str(cache / "mds")}
        dataset = Images(**where, shuffle=True, shuffle_seed=settings.seed, batch_size=settings.batch_size)
        # Streaming reads index.json here, in this process, with a boto3 client that forked
        # workers would inherit with its open connection: they then read each other's responses
        # (seen: a shard cached with another shard's bytes, samples missing and repeated, a 60 s
        # stall). Dropping the client makes each worker open its own.
        for stream in dataset.streams:
            stream._downloader.clean_up()
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=settings.batch_size,
            num_workers=settings.workers,
            persistent_workers=settings.workers > 0,
            collate_fn=collate,
        )

    def epoch(self, epoch: int) -> torch.utils.data.DataLoader:
        return self.loader  # StreamingDataset counts its own epochs, one per iteration


if __name__ == "__main__":
    sys.exit(main(None, write=write, open_loader=Loader, build=build, stored=stored))
