"""lakeshard: the shard job's format (one Parquet shard, written by ``lakeshard.format.ShardWriter``
as the job writes it) streamed by :class:`loaders.ShardLoader` on threads, in this project's
``.venv``. Remote: ``s3://`` through the loader's ranged reads (``AWS_ENDPOINT_URL``), with or
without ``cache_dir``. The decoder is the peers' (simplejpeg, image by image) unless
``PEERS_LAKESHARD_DECODER`` names another (``auto``: the loader's default, a whole batch per call).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from peer_common import JpegSet, Settings, main

from loaders import ShardLoader

DECODER = os.environ.get("PEERS_LAKESHARD_DECODER", "simplejpeg")


def write(jpegs: Path, out: Path) -> None:
    from _data import write_shards  # only here: a reading process imports just the loader

    images = JpegSet.read(jpegs)
    encoded = [path.read_bytes() for path, _ in images.images]
    labels = [label for _, label in images.images]
    write_shards(out, encoded, labels, size=images.size, quality=images.quality, classes=len(labels))


class Loader:
    def __init__(self, source: str, cache: Path | None, settings: Settings) -> None:
        self.loader = ShardLoader(
            source,
            batch_size=settings.batch_size,
            shuffle=True,
            seed=settings.seed,
            num_threads=settings.workers,
            decoder=DECODER,
            cache_dir=str(cache) if cache is not None else None,
        )

    def epoch(self, epoch: int) -> ShardLoader:
        self.loader.set_epoch(epoch)
        return self.loader


if __name__ == "__main__":
    raise SystemExit(main(None, write=write, open_loader=Loader))
