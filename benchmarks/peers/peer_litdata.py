"""LitData: chunks written by ``litdata.optimize`` (its default chunking; the JPEG bytes stored as
they are), read by ``litdata.StreamingDataset`` (shuffled) through ``litdata.StreamingDataLoader``
with ``workers`` processes, as its README recommends. Remote: ``s3://...`` through its own S3
client (the store's endpoint), whole chunks copied into ``cache_dir``, a fresh folder per run;
local: the written folder read in place.

Build (the jobs benchmark): ``litdata.optimize`` with ``num_workers=workers`` runs the per-image
work in its worker processes and writes 64 MB chunks, as its README turns a folder of images into
an optimized dataset. LitData reports no per-image times, so the work function appends each
image's finish time to a file per process in a folder beside the output.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import litdata
from build_cli import lake_images
from peer_common import Built, JpegSet, Settings, collate, decode, main
from per_image import prepare

CHUNK_BYTES = "64MB"


def _sample(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    litdata.optimize(
        fn=_sample,
        inputs=[(str(path), label) for path, label in images.images],
        output_dir=str(out),
        chunk_bytes=CHUNK_BYTES,
        num_workers=1,
    )


def _prepared(item: tuple[str, int], *, size: int, quality: int, times: str) -> dict[str, Any]:
    path, label = item
    image = prepare(Path(path).read_bytes(), size, quality)
    with open(Path(times) / str(os.getpid()), "a") as log:
        log.write(f"{time.time()!r}\n")
    return {"image": image, "label": label}


def build(lake: Path, out: Path, *, size: int, quality: int, workers: int) -> Built:
    times = Path(tempfile.mkdtemp(prefix="litdata-times-"))
    try:
        litdata.optimize(
            fn=functools.partial(_prepared, size=size, quality=quality, times=str(times)),
            inputs=[(str(path), label) for path, label in lake_images(lake)],
            output_dir=str(out),
            chunk_bytes=CHUNK_BYTES,
            num_workers=workers,
        )
        done = [float(t) for f in times.iterdir() for t in f.read_text().split()]
    finally:
        shutil.rmtree(times, ignore_errors=True)
    return {"images": len(done), "first_done": min(done, default=None), "last_done": max(done, default=None)}


def stored(out: Path) -> Iterator[tuple[int, bytes]]:
    dataset = litdata.StreamingDataset(str(out))
    for i in range(len(dataset)):
        sample = dataset[i]
        yield int(sample["label"]), sample["image"]


class Images(litdata.StreamingDataset):
    def __getitem__(self, index: Any) -> tuple[Any, int]:
        sample = super().__getitem__(index)
        return decode(sample["image"]), int(sample["label"])


class Loader:
    def __init__(self, source: str, cache: Path | None, settings: Settings) -> None:
        options: dict[str, Any] = {}
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            # LitData fetches chunks with obstore (Rust), which refuses a plain-HTTP endpoint
            # unless its client options allow it; LitData builds them from this dict and reads
            # no setting for it (real S3 is HTTPS and needs none of this).
            from litdata.streaming import downloader

            downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
        if cache is not None:
            options["cache_dir"] = str(cache)
        dataset = Images(source, shuffle=True, seed=settings.seed, **options)
        self.loader = litdata.StreamingDataLoader(
            dataset,
            batch_size=settings.batch_size,
            num_workers=settings.workers,
            persistent_workers=settings.workers > 0,
            collate_fn=collate,
        )

    def epoch(self, epoch: int) -> Any:
        return self.loader


if __name__ == "__main__":
    sys.exit(main(None, write=write, open_loader=Loader, build=build, stored=stored))
