"""torch DataLoader over plain files: one JPEG per image (``images/NNNNNN.jpg``) and an
``index.json``, read by a map-style Dataset in ``workers`` processes (fork, persistent, shuffled
by the DataLoader's sampler): what a user starts with. Remote: one ``GetObject`` per image with
boto3 (a client per worker process, made there; ``AWS_ENDPOINT_URL`` points it at the store).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from peer_common import INDEX, JpegSet, Settings, collate, decode, main


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    (out / "images").mkdir(parents=True, exist_ok=True)
    entries = []
    for path, label in images.images:
        name = f"images/{path.name}"
        shutil.copyfile(path, out / name)
        entries.append([name, label])
    (out / INDEX).write_text(json.dumps(entries))


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.rstrip("/")


class Files(torch.utils.data.Dataset):
    def __init__(self, source: str) -> None:
        self.source = source
        self.remote = source.startswith("s3://")
        self._client: Any = None
        self._pid = 0
        self.entries = json.loads(self._read(INDEX))

    def _read(self, name: str) -> bytes:
        if not self.remote:
            return (Path(self.source) / name).read_bytes()
        if self._client is None or self._pid != os.getpid():
            # One client per process: forked workers inherit the parent's, whose pooled
            # connections they would share (and read each other's responses on).
            import boto3

            self._client, self._pid = boto3.session.Session().client("s3"), os.getpid()
        bucket, prefix = _split_s3(self.source)
        return self._client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        name, label = self.entries[index]
        return decode(self._read(name)), int(label)


class Loader:
    def __init__(self, source: str, cache: Path | None, settings: Settings) -> None:
        generator = torch.Generator().manual_seed(settings.seed)
        self.loader = torch.utils.data.DataLoader(
            Files(source),
            batch_size=settings.batch_size,
            shuffle=True,
            generator=generator,
            num_workers=settings.workers,
            persistent_workers=settings.workers > 0,
            collate_fn=collate,
        )

    def epoch(self, epoch: int) -> torch.utils.data.DataLoader:
        return self.loader


if __name__ == "__main__":
    sys.exit(main(None, write=write, open_loader=Loader))
