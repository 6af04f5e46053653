"""WebDataset: tar shards written by ``webdataset.ShardWriter`` (``SHARDS`` of them, so that every
worker has shards to read and shard order shuffles), read by ``webdataset.WebDataset`` with shard
shuffling, a sample shuffle buffer and batching in ``workers`` processes of ``WebLoader``, as its
README recommends. Remote: the shards' HTTP URLs through ``pipe:curl`` (WebDataset's own way to
stream an object store over HTTP); no cache, every epoch reads every byte again.

Build (the jobs benchmark): a ``multiprocessing.Pool`` of ``workers`` does the per-image work and
one ``ShardWriter`` writes what they return into ``BUILD_SHARD_BYTES`` tar shards, as
WebDataset's examples turn a folder of images into shards.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import webdataset as wds
from build_cli import lake_images
from peer_common import Built, JpegSet, Settings, collate, decode, main
from per_image import prepare

SHARDS = 8
#: Samples shuffled together in each worker (WebDataset's examples use 1000).
SHUFFLE_BUFFER = 1000
LISTING = "shards.json"
#: Bytes per tar shard that ``build`` writes (as Mosaic's and LitData's 64 MB chunks).
BUILD_SHARD_BYTES = 64_000_000


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    per_shard = math.ceil(len(images.images) / SHARDS)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for path, label in images.images:
            sink.write({"__key__": f"{label:08d}", "jpg": path.read_bytes(), "cls": str(label)})
    shards = sorted(p.name for p in out.glob("shard-*.tar"))
    (out / LISTING).write_text(json.dumps(shards))


def _prepared(job: tuple[str, int, int, int]) -> tuple[str, bytes, int, float]:
    path, label, size, quality = job
    data = prepare(Path(path).read_bytes(), size, quality)
    return Path(path).stem, data, label, time.time()


def build(lake: Path, out: Path, *, size: int, quality: int, workers: int) -> Built:
    jobs = [(str(path), label, size, quality) for path, label in lake_images(lake)]
    done: list[float] = []
    pattern = str(out / "shard-%06d.tar")
    with (
        multiprocessing.Pool(workers) as pool,
        wds.ShardWriter(pattern, maxsize=BUILD_SHARD_BYTES, maxcount=len(jobs) + 1, verbose=0) as sink,
    ):
        for key, data, label, at in pool.imap_unordered(_prepared, jobs, chunksize=8):
            sink.write({"__key__": key, "jpg": data, "cls": str(label)})
            done.append(at)
    return {"images": len(done), "first_done": min(done, default=None), "last_done": max(done, default=None)}


def stored(out: Path) -> Iterator[tuple[int, bytes]]:
    shards = sorted(str(p) for p in out.glob("shard-*.tar"))
    for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
        yield int(sample["cls"]), sample["jpg"]


def _urls(source: str) -> list[str]:
    if not source.startswith("s3://"):
        return [str(Path(source) / name) for name in json.loads((Path(source) / LISTING).read_text())]
    endpoint = os.environ["AWS_ENDPOINT_URL"].rstrip("/")
    base = f"{endpoint}/{source.removeprefix('s3://').rstrip('/')}"
    with urllib.request.urlopen(f"{base}/{LISTING}") as response:
        names = json.loads(response.read())
    return [f"pipe:curl -s -f {base}/{name}" for name in names]


def _sample(sample: dict[str, Any]) -> tuple[Any, int]:
    return decode(sample["jpg"]), int(sample["cls"])


class Loader:
    def __init__(self, source: str, cache: Path | None, settings: Settings) -> None:
        dataset = (
            wds.WebDataset(
                _urls(source),
                shardshuffle=SHARDS,
                nodesplitter=wds.split_by_node,
                workersplitter=wds.split_by_worker,
                seed=settings.seed,
            )
            .shuffle(SHUFFLE_BUFFER)
            .map(_sample)
            .batched(settings.batch_size, collation_fn=collate, partial=True)
        )
        self.loader = wds.WebLoader(
            dataset, batch_size=None, num_workers=settings.workers, persistent_workers=settings.workers > 0
        )

    def epoch(self, epoch: int) -> Any:
        return self.loader


if __name__ == "__main__":
    sys.exit(main(None, write=write, open_loader=Loader, build=build, stored=stored))
