"""Mosaic Streaming: MDS shards written by ``streaming.MDSWriter`` (its default 64 MiB
``size_limit``, no compression: JPEGs do not compress), read by ``streaming.StreamingDataset``
(shuffled, its default ``py1e`` algorithm, ``batch_size`` given so it partitions by batch) in
``workers`` processes of a torch DataLoader, as its docs recommend. Remote: ``remote=s3://...``
through its boto3 downloader (``S3_ENDPOINT_URL``), whole shards copied into ``local``, a fresh
cache folder per run; local: ``local=`` the written folder, no remote.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from peer_common import JpegSet, Settings, collate, decode, main
from streaming import MDSWriter, StreamingDataset
from streaming.base.util import clean_stale_shared_memory


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}) as sink:
        for path, label in images.images:
            sink.write({"image": path.read_bytes(), "label": label})


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
    sys.exit(main(None, write=write, open_loader=Loader))
