"""WebDataset: tar shards written by ``webdataset.ShardWriter`` (``SHARDS`` of them, so that every
worker has shards to read and shard order shuffles), read by ``webdataset.WebDataset`` with shard
shuffling, a sample shuffle buffer and batching in ``workers`` processes of ``WebLoader``, as its
README recommends. Remote: the shards' HTTP URLs through ``pipe:curl`` (WebDataset's own way to
stream an object store over HTTP); no cache, every epoch reads every byte again.
"""

from __future__ import annotations

import json
import math
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import webdataset as wds
from peer_common import JpegSet, Settings, collate, decode, main

SHARDS = 8
#: Samples shuffled together in each worker (WebDataset's examples use 1000).
SHUFFLE_BUFFER = 1000
LISTING = "shards.json"


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    per_shard = math.ceil(len(images.images) / SHARDS)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for path, label in images.images:
            sink.write({"__key__": f"{label:08d}", "jpg": path.read_bytes(), "cls": str(label)})
    shards = sorted(p.name for p in out.glob("shard-*.tar"))
    (out / LISTING).write_text(json.dumps(shards))


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
    sys.exit(main(None, write=write, open_loader=Loader))
