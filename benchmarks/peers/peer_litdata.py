"""LitData: chunks written by ``litdata.optimize`` (its default chunking; the JPEG bytes stored as
they are), read by ``litdata.StreamingDataset`` (shuffled) through ``litdata.StreamingDataLoader``
with ``workers`` processes, as its README recommends. Remote: ``s3://...`` through its own S3
client (the store's endpoint), whole chunks copied into ``cache_dir``, a fresh folder per run;
local: the written folder read in place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import litdata
from peer_common import JpegSet, Settings, collate, decode, main


def _sample(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    litdata.optimize(
        fn=_sample,
        inputs=[(str(path), label) for path, label in images.images],
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=1,
    )


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
    sys.exit(main(None, write=write, open_loader=Loader))
