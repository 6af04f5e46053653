"""Does the loader keep a GPU node busy? Thread scaling, a real model fed by the loader, nccl,
and GPU-side decoding, in one command.

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "A GPU node".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import int_list
from _data import seeded_jpeg, write_shards
from _timing import write_json
from loader_bench import bench_ceiling

from loaders import ShardLoader
from loaders.decode import BATCH_DECODERS, has_simplejpeg

SIZE, QUALITY, CLASSES = 224, 95, 1000
#: ImageNet's mean and std on the 0-255 scale: the normalisation done on the GPU.
MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)


# -- the dataset ------------------------------------------------------------------------------------
def build(root: Path, *, images: int, unique: int) -> list[bytes]:
    """The dataset at ``root`` (kept when it already has ``images`` rows): its encoded images."""
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        distinct = list(pool.map(seeded_jpeg, [(i, SIZE, QUALITY) for i in range(unique)], chunksize=64))
    encoded = [distinct[i % unique] for i in range(images)]
    marker = root / f".rows-{images}-{unique}"
    if not marker.exists():
        root.mkdir(parents=True, exist_ok=True)
        labels = [i % CLASSES for i in range(images)]
        write_shards(root, encoded, labels, size=SIZE, quality=QUALITY, classes=CLASSES)
        marker.touch()
    return encoded


# -- one process of the thread scaling ------------------------------------------------------------
def timed(loader: ShardLoader, seconds: float, consume: Any) -> dict[str, float]:
    """``loader`` kept over ``seconds`` after its first batch (epochs roll over as a training
    loop's do), each batch through ``consume`` (which returns its images): the images, the
    seconds and this process's CPU seconds meanwhile. Closes the loader."""
    epoch, it = 0, iter(loader)
    consume(next(it))
    me = psutil.Process()
    cpu0, t0, n = sum(me.cpu_times()[:2]), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        try:
            n += consume(next(it))
        except StopIteration:
            epoch += 1
            loader.set_epoch(epoch)
            it = iter(loader)
    elapsed, cpu = time.perf_counter() - t0, sum(me.cpu_times()[:2]) - cpu0
    loader.close()
    return {"images": n, "seconds": elapsed, "cpu_s": cpu}


def measure(
    dataset: str, *, rank: int, world: int, threads: int, seconds: float, decoder: str
) -> dict[str, float]:
    """One process of the thread scaling: a kept loader of rank ``rank`` of ``world``."""
    loader = ShardLoader(
        dataset,
        rank=rank,
        world_size=world,
        batch_size=256,
        shuffle=True,
        num_threads=threads,
        decoder=decoder,
    )
    return timed(loader, seconds, lambda batch: len(batch[1]))


def _run_ranks(
    dataset: Path, ranks: int, threads: int, seconds: float, decoder: str = "auto"
) -> dict[str, Any]:
    """``ranks`` processes of ``threads`` threads at once: images/s summed, CPU per image overall."""
    child = [sys.executable, __file__, "measure", str(dataset)]
    procs = [
        subprocess.Popen(
            [*child, *map(str, (r, ranks, threads, seconds)), decoder], stdout=subprocess.PIPE, text=True
        )
        for r in range(ranks)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 300)
        if p.returncode != 0:
            raise SystemExit(f"measure (ranks={ranks}, threads={threads}) failed with exit {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    images = sum(r["images"] for r in results)
    return {
        "ranks": ranks,
        "threads": threads,
        "images_per_s": sum(r["images"] / r["seconds"] for r in results),
        "cpu_s_per_image": sum(r["cpu_s"] for r in results) / max(images, 1),
    }


def scaling(dataset: Path, encoded: list[bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    configs = [(1, t) for t in args.threads] + [(args.ranks, args.rank_threads)]
    ceiling_args = argparse.Namespace(decoder="auto", batch_size=256)
    rows = []
    for ranks, threads in configs:
        row = _run_ranks(dataset, ranks, threads, args.seconds)
        # The ceiling on as many threads as all ranks have, over about as many images.
        sample = encoded[: max(256 * ranks * threads * 2, min(len(encoded), int(row["images_per_s"] * 2)))]
        row["ceiling_images_per_s"] = bench_ceiling(sample, SIZE, ceiling_args, ranks * threads)
        row["vs_ceiling"] = row["images_per_s"] / row["ceiling_images_per_s"]
        rows.append(row)
        print(
            f"  {ranks} x {threads:2d} threads: {row['images_per_s']:9.0f} images/s, "
            f"{row['cpu_s_per_image'] * 1e3:.3f} ms CPU/image, ceiling {row['ceiling_images_per_s']:9.0f} "
            f"({row['vs_ceiling']:.2f})",
            flush=True,
        )
    return rows


# -- the model ---------------------------------------------------------------------------------------
def _model(cuda: bool) -> tuple[torch.nn.Module, str]:
    if not cuda:
        from loaders.train.model import build_model

        return build_model(None, CLASSES, SIZE, width=8), "the trainer's small CNN (width 8), CPU"
    try:
        import torchvision

        return torchvision.models.resnet50(num_classes=CLASSES), "torchvision resnet50"
    except Exception:
        import timm

        return timm.create_model("resnet50", num_classes=CLASSES), "timm resnet50"


def model_fed(dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The model fed by the loader against the same model fed one batch already on the device."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model, name = _model(cuda)
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        x = ((images.to(device, non_blocking=True).float() - mean) / std).contiguous(
            memory_format=torch.channels_last
        )
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model(x), labels.to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    loader = ShardLoader(
        str(dataset), batch_size=args.batch_size, shuffle=True, pin_memory=cuda, num_threads=os.cpu_count()
    )
    it = iter(loader)
    fixed = next(it)
    for _ in range(args.warmup):
        step(*fixed)
    sync()
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        w = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        wait += time.perf_counter() - w
        step(*batch)
    sync()
    fed = args.steps * args.batch_size / (time.perf_counter() - t0)
    loader.close()
    on_device = (fixed[0].to(device), fixed[1].to(device))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(*on_device)
    sync()
    ceiling = args.steps * args.batch_size / (time.perf_counter() - t0)
    total = args.steps * args.batch_size / fed
    return {
        "model": name,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "batch_size": args.batch_size,
        "steps": args.steps,
        "fed_images_per_s": fed,
        "ceiling_images_per_s": ceiling,
        "vs_ceiling": fed / ceiling,
        "data_wait_share": wait / total,
    }


# -- nccl through the trainer ---------------------------------------------------------------------
def torchrun(dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="node-bench-train-") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        command += ["-m", "loaders.train", "--dataset", str(dataset), "--epochs", "1", "--width", "8"]
        command += ["--batch-size", str(args.train_batch_size), "--output", out, "--no-progress"]
        t0 = time.perf_counter()
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1]
        )
        seconds = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        backend = next((b for b in ("nccl", "gloo") if f"joined the {b} process group" in log), None)
        metrics = Path(out) / "metrics.json"
        result = {
            "exit": proc.returncode,
            "backend": backend,
            "seconds": seconds,
            "metrics_written": metrics.exists(),
        }
        if proc.returncode != 0:
            result["log_tail"] = log[-2000:]
        return result


# -- GPU decoding ------------------------------------------------------------------------------------
def _rate(loader: ShardLoader, seconds: float, consume: Any) -> dict[str, float]:
    t = timed(loader, seconds, consume)
    return {"images_per_s": t["images"] / t["seconds"], "cpu_s_per_image": t["cpu_s"] / max(t["images"], 1)}


def gpu_decode(dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    opts = {"batch_size": 256, "shuffle": True, "num_threads": os.cpu_count()}
    out: dict[str, Any] = {
        "encoded_only": _rate(
            ShardLoader(str(dataset), decoder="none", **opts), args.seconds, lambda b: len(b.labels)
        )
    }
    if not torch.cuda.is_available():
        out["skipped"] = "CUDA is not available"
        return out
    try:
        from torchvision.io import decode_jpeg
    except Exception as exc:  # torchvision missing, or built for another torch
        out["skipped"] = f"torchvision.io.decode_jpeg cannot be imported ({type(exc).__name__}: {exc})"
        return out

    def on_gpu(batch: Any) -> int:
        images = torch.stack(decode_jpeg(batch.images, device="cuda"))
        torch.cuda.synchronize()
        return len(images)

    def cpu_decoded(batch: Any) -> int:
        batch[0].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        return len(batch[1])

    out["gpu_decode"] = _rate(ShardLoader(str(dataset), decoder="none", **opts), args.seconds, on_gpu)
    out["cpu_decode"] = _rate(ShardLoader(str(dataset), pin_memory=True, **opts), args.seconds, cpu_decoded)
    return out


# -- main ----------------------------------------------------------------------------------------------
#: Each size: its type, what it is, and its default on a node and with ``--small``.
SIZES: dict[str, tuple[Any, str, Any, Any]] = {
    "images": (int, "rows in the dataset", 200_000, 2_000),
    "unique": (int, "distinct images among them", 4_000, 256),
    "threads": (int_list, "decode threads of one process", [1, 2, 4, 8, 16], [1, 2]),
    "ranks": (int, "processes at once for the last row", 2, 2),
    "rank_threads": (int, "threads of each of them", 8, 1),
    "seconds": (float, "measured per configuration", 6.0, 1.5),
    "batch_size": (int, "the model's batch", 256, 16),
    "steps": (int, "the model's measured steps", 60, 3),
    "warmup": (int, "steps before those", 10, 1),
    "train_images": (int, "rows of the torchrun run's dataset", 20_000, 64),
    "train_batch_size": (int, "its batch", 256, 16),
}


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else f"{value:,g}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="a CPU-sized run (under 2 minutes on 2 cores)")
    for name, (kind, what, full, small) in SIZES.items():
        default = f"default {_shown(full)}" + (f"; --small {_shown(small)}" if small != full else "")
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"{what} ({default})")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "node-bench")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    for name, (_, _, full, small) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    for name in ("images", "unique", "ranks", "rank_threads", "batch_size", "steps", "train_images"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seconds <= 0:
        p.error(f"--seconds must be positive, got {args.seconds}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["measure"]:  # one process of the thread scaling (run by _run_ranks)
        dataset, rank, world, threads, seconds, decoder = argv[1:]
        r, w, t, s = int(rank), int(world), int(threads), float(seconds)
        print(json.dumps(measure(dataset, rank=r, world=w, threads=t, seconds=s, decoder=decoder)))
        return 0
    args = parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'no GPU'}",
        "decoders": {"loaders._jpeg": bool(BATCH_DECODERS), "simplejpeg": has_simplejpeg()},
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(result["machine"], "| decoders:", result["decoders"], flush=True)
    dataset = args.workdir / f"ds-{args.images}"
    encoded = build(dataset, images=args.images, unique=args.unique)
    print(f"dataset: {args.images} rows ({len(set(map(id, encoded)))} distinct) in {dataset}", flush=True)
    print("thread scaling:", flush=True)
    result["scaling"] = scaling(dataset, encoded, args)
    del encoded
    result["model"] = model_fed(dataset, args)
    m = result["model"]
    print(
        f"model ({m['model']}, batch {m['batch_size']}): fed {m['fed_images_per_s']:.0f} images/s, "
        f"on-device batch {m['ceiling_images_per_s']:.0f} ({m['vs_ceiling']:.2f}), data wait "
        f"{m['data_wait_share']:.1%}",
        flush=True,
    )
    train_set = args.workdir / f"train-{args.train_images}"
    build(train_set, images=args.train_images, unique=min(args.unique, args.train_images))
    result["torchrun"] = torchrun(train_set, args)
    t = result["torchrun"]
    print(
        f"torchrun --nproc_per_node=1 loaders.train: exit {t['exit']}, backend {t['backend']}, {t['seconds']:.1f} s"
    )
    result["gpu_decode"] = gpu_decode(dataset, args)
    g = result["gpu_decode"]
    e = g["encoded_only"]
    print(
        f"encoded batches only: {e['images_per_s']:.0f} images/s, {e['cpu_s_per_image'] * 1e3:.3f} ms CPU/image"
    )
    if "skipped" in g:
        print(f"GPU decoding: not run: {g['skipped']}")
    else:
        for k in ("gpu_decode", "cpu_decode"):
            print(
                f"{k}: {g[k]['images_per_s']:.0f} images/s, {g[k]['cpu_s_per_image'] * 1e3:.3f} ms CPU/image"
            )
    result["seconds"] = time.perf_counter() - started
    print(f"done in {result['seconds']:.0f} s")
    write_json(args.out, result, indent=1)
    return 0 if t["exit"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
