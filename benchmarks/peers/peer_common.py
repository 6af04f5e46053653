"""What every tool's process shares: the decoder, the epoch loop, and how the process tree's CPU
and memory are read. Imports only what every peer's virtual environment has (numpy, torch,
simplejpeg, psutil; ``benchmarks/_timing.py`` needs no more), never this project: each tool runs
in its own environment.

A tool module (``peer_<tool>.py``) has ``write(jpegs, out)`` (its own writer, from the JPEG set
that ``run.py`` made) and ``open_loader(source, cache, settings)``, returning an object with
``epoch(e)``: an iterable of ``(images, labels)`` batches, images uint8 ``[B, 3, H, W]`` (a view
of NHWC, as ours yields), labels int64. Every set is written with label = the image's index, so
the labels of an epoch tell whether each image came exactly once.

For the jobs benchmark (``jobs_run.py``) a tool module also has ``build(lake, out, *, size,
quality, workers)``: it reads the raw lake (``build_cli.lake_images``), does the per-image work
(``per_image.prepare``) on ``workers`` processes or threads the tool's own way, writes its format
under ``out``, and returns a :data:`Built` dict; and ``stored(out)``, every ``(label, image
bytes)`` its format holds (the benchmark compares them with the per-image work's bytes). Given
to :func:`main` (``build=build, stored=stored``), they are its ``build`` and ``stored``
subcommands (``build_cli.py``).

``python peer_<tool>.py read ...`` runs :func:`main` here: it builds the loader, runs epoch 1
at once, prints one JSON line per epoch on stdout, and before each later epoch waits for a line
on stdin (the parent reads the store's traffic between epochs; the wait is not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import psutil
import simplejpeg
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import tree_cpu_s
from build_cli import Build, Stored, add_build_commands, run_build_command

BATCH_SIZE = 64
#: Read by each tool's writer: ``index.json`` holds ``size``, ``quality`` and ``images``,
#: ``[file name, label]`` per image.
INDEX = "index.json"


def decode(data: bytes | memoryview) -> np.ndarray:
    """The one decoder every tool uses: libjpeg-turbo through simplejpeg, RGB, HWC uint8."""
    return simplejpeg.decode_jpeg(data, colorspace="RGB")


def collate(samples: list[tuple[np.ndarray, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the loader under test yields it: uint8 ``[B, 3, H, W]`` over NHWC memory."""
    images = torch.from_numpy(np.stack([s[0] for s in samples]))
    labels = torch.tensor([int(s[1]) for s in samples], dtype=torch.int64)
    return images.permute(0, 3, 1, 2), labels


def as_batch(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DataLoader's NHWC batch as ``[B, 3, H, W]`` (a view, no copy)."""
    return images.permute(0, 3, 1, 2), labels


@dataclasses.dataclass(frozen=True)
class JpegSet:
    """The JPEG set ``run.py`` wrote: every image ``size`` px square at ``quality``, and
    ``(path, label)`` per image, label = index."""

    size: int
    quality: int
    images: list[tuple[Path, int]]

    @classmethod
    def read(cls, folder: Path) -> JpegSet:
        index = json.loads((folder / INDEX).read_text())
        images = [(folder / name, int(label)) for name, label in index["images"]]
        return cls(size=int(index["size"]), quality=int(index["quality"]), images=images)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How every tool is run: the same batch, shuffle seed and worker count (``workers`` is the
    processes or threads that decode: one per core unless ``--workers`` says otherwise)."""

    batch_size: int
    workers: int
    seed: int
    images: int


#: What a tool's ``build`` returns (``build_cli.Build``).
Built = dict[str, Any]


class Loader(Protocol):
    def epoch(self, epoch: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]: ...


# -- the process tree ---------------------------------------------------------------------------------
class MemorySampler:
    """The peak, over an interval, of the tree's summed RSS and summed PSS (proportional set
    size: a page shared by N processes counts 1/N in each, so forked workers' shared pages count
    once), sampled every ``period`` seconds on a daemon thread."""

    def __init__(self, period: float = 0.2) -> None:
        self.period = period
        self.peak_rss = 0
        self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.peak_rss = self.peak_pss = 0
        self.sample()

    def sample(self) -> None:
        me = psutil.Process()
        rss = pss = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                info = proc.memory_full_info()
            except psutil.Error:
                continue
            rss += info.rss
            pss += info.pss
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- one process: build a loader, run its epochs ----------------------------------------------------------
def run_epochs(
    make_loader: Callable[[], Loader],
    *,
    epochs: int,
    images: int,
    started_at: float,
    wait: Callable[[], None],
) -> list[dict[str, Any]]:
    """Epoch by epoch: images/s, the first batch's wait (epoch 1: from before the loader is made,
    so a fresh loader's start is in it), CPU seconds of the tree, peak memory, and whether every
    label in ``range(images)`` came exactly once. ``started_at`` is the parent's ``time.time()``
    just before it started this process (the new process's first batch is measured from it)."""
    memory = MemorySampler()
    records = []
    try:
        loader: Loader | None = None
        for epoch in range(epochs):
            if epoch:
                wait()
            memory.reset()
            cpu0, t0 = tree_cpu_s(), time.perf_counter()
            if loader is None:
                loader = make_loader()
            seen = np.zeros(images, dtype=np.int64)
            first = None
            count = 0
            for batch_images, labels in loader.epoch(epoch):
                if first is None:
                    first = time.perf_counter() - t0
                    first_wall = time.time()
                seen += np.bincount(labels.numpy(), minlength=images)[:images]
                count += len(labels)
                assert batch_images.dtype == torch.uint8 and batch_images.shape[1] == 3, batch_images.shape
            seconds = time.perf_counter() - t0
            cpu = tree_cpu_s() - cpu0
            memory.sample()
            record = {
                "epoch": epoch + 1,
                "images": count,
                "seconds": seconds,
                "images_per_s": count / seconds,
                "first_batch_s": first,
                "cpu_s": cpu,
                "cpu_s_per_image": cpu / max(count, 1),
                "peak_rss": memory.peak_rss,
                "peak_pss": memory.peak_pss,
                "missing": int((seen == 0).sum()),
                "repeated": int((seen > 1).sum()),
                "exactly_once": bool((seen == 1).all() and count == images),
            }
            if epoch == 0 and first is not None:
                record["process_first_batch_s"] = first_wall - started_at
            records.append(record)
            print(json.dumps(record), flush=True)
    finally:
        memory.close()
    return records


def main(
    argv: list[str] | None,
    *,
    write: Callable[[Path, Path], None],
    open_loader: Callable[[str, Path | None, Settings], Loader],
    build: Build | None = None,
    stored: Stored | None = None,
) -> int:
    """The command line of every ``peer_<tool>.py``: ``write --jpegs DIR --out DIR``,
    ``read --source PATH_OR_URI [--cache DIR] --images N ...`` or (a tool with ``build``)
    ``build --lake DIR --out DIR --size S --quality Q --workers W`` and ``stored --out DIR``
    (a line ``<label> <sha256 of the image>`` per stored image)."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write this tool's format from the JPEG set")
    w.add_argument("--jpegs", type=Path, required=True, help="the folder run.py wrote (index.json)")
    w.add_argument("--out", type=Path, required=True, help="an empty folder for this tool's files")
    r = sub.add_parser("read", help="stream the written files, print one JSON line per epoch")
    r.add_argument("--source", required=True, help="what write produced: a local folder or s3://...")
    r.add_argument("--cache", type=Path, help="an empty local cache folder, for tools that take one")
    r.add_argument("--images", type=int, required=True, help="images in the set (labels 0..N-1)")
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    r.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--started-at", type=float, default=None, help="the parent's time.time() at start")
    if build is not None and stored is not None:
        add_build_commands(sub)
    args = parser.parse_args(argv)
    if args.command in ("build", "stored"):
        assert build is not None and stored is not None
        return run_build_command(args, build, stored)
    if args.command == "write":
        args.out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write(args.jpegs, args.out)
        print(json.dumps({"write_s": time.perf_counter() - t0}), flush=True)
        return 0
    settings = Settings(batch_size=args.batch_size, workers=args.workers, seed=args.seed, images=args.images)
    run_epochs(
        lambda: open_loader(args.source, args.cache, settings),
        epochs=args.epochs,
        images=args.images,
        started_at=args.started_at if args.started_at is not None else time.time(),
        wait=lambda: sys.stdin.readline(),
    )
    return 0
