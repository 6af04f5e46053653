"""How fast does ShardLoader feed a training loop, against what the machine can decode?

```
python benchmarks/loader_bench.py --images 2000 --size 224 --repeats 3 --out bench.json
python benchmarks/loader_bench.py --dataset s3://lake/datasets/pets-v1 --channel train
```

Measures (median of ``--repeats`` runs, images/s):

* ``shardloader``: one full epoch of :class:`loaders.ShardLoader` (rank 0 of 1), and its time to
  first batch;
* ``decode_ceiling``: the same encoded bytes, already in memory, decoded by a thread pool over
  batch-sized chunks on all cores with the same decoder: the best a threaded loader can do;
* ``dataloader_files``: ``torch.utils.data.DataLoader(num_workers=2)`` over the same images as
  individual files (an ImageFolder-like Dataset decoding with Pillow; torchvision is not
  installed here);
* ``decode_pillow`` / ``decode_simplejpeg``: one thread, the two decoders.

Targets (reported, not asserted): shardloader >= 0.9 x decode_ceiling and >= 2 x
dataloader_files.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import contract
from loaders import ShardLoader
from loaders.decode import decode_pillow, get_decoder, has_simplejpeg

log = logging.getLogger("loader_bench")


def synthetic_image(rng: np.random.Generator, size: int) -> np.ndarray:
    """A smooth colour field (upsampled coarse noise) plus fine noise and a gradient: JPEG
    sizes like photos (~10-20 KB at 224px, quality 90)."""
    coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), dtype=np.float32)
    ramp = np.linspace(-40, 40, size, dtype=np.float32)[None, :, None]
    noise = rng.normal(0, 6, size=(size, size, 3)).astype(np.float32)
    return np.clip(field + ramp + noise, 0, 255).astype(np.uint8)


def build_dataset(root: Path, *, images: int, size: int, quality: int, classes: int = 10) -> None:
    """One train shard following the contract, plus the same JPEGs as files under ``root/files``."""
    rng = np.random.default_rng(0)
    encoded, labels = [], []
    for i in range(images):
        buf = io.BytesIO()
        Image.fromarray(synthetic_image(rng, size)).save(buf, format="JPEG", quality=quality)
        encoded.append(buf.getvalue())
        labels.append(i % classes)
        path = root / "files" / f"class{i % classes}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encoded[-1])
    version = hashlib.sha256(b"".join(encoded[:10])).hexdigest()[:16]
    mean_bytes = sum(map(len, encoded)) / len(encoded)
    channels: dict[str, Any] = {}
    for channel in contract.CHANNELS:
        n = images if channel == "train" else classes
        table = pa.table(
            {
                "image": pa.array(encoded[:n], pa.binary()),
                "label": pa.array(labels[:n], pa.int64()),
                "uri": pa.array([f"file:///bench/{i}.jpg" for i in range(n)]),
                "key": pa.array([f"{i}.jpg" for i in range(n)]),
                "height": pa.array([size] * n, pa.int32()),
                "width": pa.array([size] * n, pa.int32()),
                "is_pad": pa.array([False] * n),
            },
            schema=contract.SHARD_SCHEMA,
        ).replace_schema_metadata(
            {
                b"lakeshard.dataset_version": version.encode(),
                b"lakeshard.channel": channel.encode(),
                b"lakeshard.shard_index": b"0",
                b"lakeshard.num_shards": b"1",
            }
        )
        rel = f"shards/{channel}/{contract.shard_name(0, 1)}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / rel, row_group_size=max(1, int(4 * 2**20 / mean_bytes)))
        channels[channel] = {"rows": n, "rows_per_shard": n, "shards": [{"path": rel, "rows": n}]}
    info = {
        "format_version": 1, "dataset_version": version, "labels": {str(c): c for c in range(classes)},
        "num_classes": classes, "image": {"size": size, "format": "jpeg", "quality": quality, "resize": "crop"},
        "num_shards": 1, "remainder": "drop", "seed": 0, "channels": channels,
    }  # fmt: skip
    (root / "labels.json").write_text(json.dumps({f"class{c}": c for c in range(classes)}))
    (root / "dataset.json").write_text(json.dumps(info))


def read_encoded(dataset: str, channel: str) -> list[bytes]:
    loader = ShardLoader(dataset, channel=channel)  # for the shard list only
    out: list[bytes] = []
    for uri in loader.shard_uris:
        with open(uri.removeprefix("file://"), "rb") if uri.startswith("file://") else _fs_open(uri) as f:
            out.extend(pq.read_table(f, columns=["image"]).column("image").to_pylist())
    return out


def _fs_open(uri: str) -> Any:
    from jobs import storage

    fs, path = storage.filesystem(uri)
    return fs.open(path, "rb")


def bench_loader(dataset: str, args: argparse.Namespace) -> tuple[float, float, int]:
    loader = ShardLoader(
        dataset, channel=args.channel, batch_size=args.batch_size, shuffle=True, seed=0,
        num_threads=args.threads, prefetch=args.prefetch, decoder=args.decoder,
    )  # fmt: skip
    start = time.perf_counter()
    it = iter(loader)
    images, _ = next(it)
    first = time.perf_counter() - start
    n = len(images)
    for images, _ in it:
        n += len(images)
    return n / (time.perf_counter() - start), first, n


def bench_ceiling(encoded: list[bytes], size: int, args: argparse.Namespace) -> float:
    decoder = get_decoder(args.decoder)

    def chunk(lo: int) -> int:
        part = encoded[lo : lo + args.batch_size]
        out = np.empty((len(part), size, size, 3), dtype=np.uint8)
        for i, data in enumerate(part):
            decoder(data, out[i])
        torch.from_numpy(out).permute(0, 3, 1, 2)  # the loader's (zero-copy) layout
        return len(part)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        start = time.perf_counter()
        n = sum(pool.map(chunk, range(0, len(encoded), args.batch_size)))
        return n / (time.perf_counter() - start)


def bench_single(encoded: list[bytes], size: int, decoder: Any) -> float:
    out = np.empty((size, size, 3), dtype=np.uint8)
    start = time.perf_counter()
    for data in encoded:
        decoder(data, out)
    return len(encoded) / (time.perf_counter() - start)


class FileImages(torch.utils.data.Dataset):
    """ImageFolder-like: ``root/<class>/<file>``, decoded with Pillow to uint8 CHW."""

    def __init__(self, root: Path) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(p, i) for i, c in enumerate(classes) for p in sorted((root / c).iterdir())]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[index]
        return torch.from_numpy(decode_pillow(path.read_bytes()).copy()).permute(2, 0, 1).contiguous(), label


def bench_dataloader(files: Path, args: argparse.Namespace) -> tuple[float, float]:
    loader = torch.utils.data.DataLoader(FileImages(files), batch_size=args.batch_size, shuffle=True, num_workers=2)
    start = time.perf_counter()
    it = iter(loader)
    images, _ = next(it)
    first = time.perf_counter() - start
    n = len(images)
    for images, _ in it:
        n += len(images)
    return n / (time.perf_counter() - start), first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", help="an existing dataset root (default: build a synthetic one)")
    parser.add_argument("--channel", default="train")
    parser.add_argument("--images", type=int, default=2000, help="images in the synthetic dataset")
    parser.add_argument("--size", type=int, default=224, help="image size of the synthetic dataset")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the synthetic dataset")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2 * (os.cpu_count() or 1), help="ShardLoader decode threads")
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--decoder", default="auto", help="auto, pillow or simplejpeg")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", help="where to build the synthetic dataset (default: a temporary folder)")
    parser.add_argument("--out", default="loader_bench.json", help="JSON results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        files: Path | None = None
        if args.dataset:
            dataset = args.dataset
        else:
            dataset = str(work / "bench-ds")
            files = work / "bench-ds" / "files"
            if not (work / "bench-ds" / "dataset.json").exists():
                log.info("building %d synthetic %dpx JPEGs in %s", args.images, args.size, dataset)
                build_dataset(Path(dataset), images=args.images, size=args.size, quality=args.quality)
        size = ShardLoader(dataset, channel=args.channel).image_size
        encoded = read_encoded(dataset, args.channel)
        log.info("%d images, mean %.1f KB encoded", len(encoded), sum(map(len, encoded)) / len(encoded) / 1e3)

        runs: dict[str, list[float]] = {}

        def record(name: str, value: float) -> None:
            runs.setdefault(name, []).append(value)

        bench_loader(dataset, args)  # warm the page cache and the imports
        for r in range(args.repeats):
            rate, first, _ = bench_loader(dataset, args)
            record("shardloader", rate)
            record("shardloader_first_batch_s", first)
            record("decode_ceiling", bench_ceiling(encoded, size, args))
            record("decode_pillow", bench_single(encoded, size, decode_pillow))
            if has_simplejpeg():
                record("decode_simplejpeg", bench_single(encoded, size, get_decoder("simplejpeg")))
            if files is not None:
                rate, first = bench_dataloader(files, args)
                record("dataloader_files", rate)
                record("dataloader_files_first_batch_s", first)
            log.info("repeat %d/%d done", r + 1, args.repeats)

    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {"shardloader_vs_ceiling": med["shardloader"] / med["decode_ceiling"]}
    if "dataloader_files" in med:
        ratios["shardloader_vs_dataloader"] = med["shardloader"] / med["dataloader_files"]
    if "decode_simplejpeg" in med:
        ratios["simplejpeg_vs_pillow"] = med["decode_simplejpeg"] / med["decode_pillow"]

    print(f"{'measure':34s} {'median':>12s}   runs")
    for k, v in med.items():
        unit = "s" if k.endswith("_s") else "images/s"
        print(f"{k:34s} {v:12.3f} {unit:8s} {' '.join(f'{x:.3f}' for x in runs[k])}")
    for k, v in ratios.items():
        print(f"{k:34s} {v:12.2f} x")
    result = {
        "args": vars(args), "images": len(encoded), "image_size": size, "cpu_count": os.cpu_count(),
        "median": med, "runs": runs, "ratios": ratios,
        "targets": {"shardloader_vs_ceiling": 0.9, "shardloader_vs_dataloader": 2.0},
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
