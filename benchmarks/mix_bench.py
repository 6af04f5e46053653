"""Does a mixture of two local datasets stream within noise of one dataset of the same rows?

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "A mixture against
one dataset".
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import platform
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import positive, work_folder, write_out
from _data import seeded_jpeg, write_shards
from _timing import other_load, paired

from lakeshard import format as contract
from loaders import MixedLoader, ShardLoader, default_threads
from loaders._internal.mixing import shares

VARIANTS = ("single", "mix")
#: ``--small``: the defaults it changes (an option given on the command line wins).
SMALL = {"images": 1024, "repeats": 1}
DEFAULTS = {"images": 4096, "repeats": 3, "epochs": 3}
#: A mixture "clearly" slower than this (as a share of single's images/s) is outside noise,
#: whatever the spread of single's repeats.
NOISE_FLOOR = 0.05
#: Warn when other processes took more than this share of the machine's CPU during the runs.
BUSY = 0.10


# -- the datasets ---------------------------------------------------------------------------------
def split_a(images: int, rows_a: int) -> list[bool]:
    """Which of ``images`` indices go to A: ``rows_a`` of them, spread evenly (image ``i`` when
    ``floor((i + 1) * rows_a / images)`` steps up), the rest to B."""
    return [(i + 1) * rows_a // images > i * rows_a // images for i in range(images)]


def build(work: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Datasets A, B and C under ``work`` (kept when built before with the same settings): per
    dataset its URI, rows, dataset_version and mean encoded bytes per image."""
    rows_a, rows_b = shares([args.split, 1 - args.split], args.images)
    key = f"n{args.images}-s{args.size}-q{args.quality}-c{args.classes}-a{rows_a}"
    roots = {name: work / f"mix-bench-{key}" / name for name in ("A", "B", "C")}
    marker = work / f"mix-bench-{key}" / ".complete"
    in_a = split_a(args.images, rows_a)
    if not marker.exists():
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
            jobs = [(i, args.size, args.quality) for i in range(args.images)]
            encoded = list(pool.map(seeded_jpeg, jobs, chunksize=64))
        labels = [i % args.classes for i in range(args.images)]
        parts = {
            "A": [i for i in range(args.images) if in_a[i]],
            "B": [i for i in range(args.images) if not in_a[i]],
            "C": list(range(args.images)),
        }
        for name, index in parts.items():
            roots[name].mkdir(parents=True, exist_ok=True)
            write_shards(
                roots[name],
                [encoded[i] for i in index],
                [labels[i] for i in index],
                size=args.size,
                quality=args.quality,
                classes=args.classes,
            )
        marker.touch()
        print(f"built A, B, C ({args.images} images) in {time.perf_counter() - t0:.1f} s", flush=True)
    expected = {"A": rows_a, "B": rows_b, "C": args.images}
    out: dict[str, dict[str, Any]] = {}
    for name, root in roots.items():
        sizes = _jpeg_bytes(root)
        if len(sizes) != expected[name]:
            raise SystemExit(f"mix_bench: {root} has {len(sizes)} rows, expected {expected[name]}")
        out[name] = {
            "uri": str(root),
            "dataset_version": contract.read_dataset_info(str(root)).dataset_version,
            "rows": len(sizes),
            "mean_jpeg_bytes": round(sum(sizes) / len(sizes), 1),
            "total_jpeg_bytes": sum(sizes),
        }
    versions = {d["dataset_version"] for d in out.values()}
    if len(versions) != 3:
        raise SystemExit(f"mix_bench: the datasets share a dataset_version: {out}")
    # The same bytes: A and B together are C.
    if out["A"]["total_jpeg_bytes"] + out["B"]["total_jpeg_bytes"] != out["C"]["total_jpeg_bytes"]:
        raise SystemExit(f"mix_bench: A and B do not hold C's bytes: {out}")
    return out


def _jpeg_bytes(root: Path) -> list[int]:
    """Encoded bytes of each image of the train channel of the dataset at ``root`` (its one shard)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    column = pq.read_table(root / contract.shard_relpath("train", 0, 1), columns=["image"]).column("image")
    return list(pc.binary_length(column).to_pylist())


# -- one run ----------------------------------------------------------------------------------------
def make_loader(variant: str, data: dict[str, dict[str, Any]], args: argparse.Namespace) -> Any:
    common = {
        "channel": "train",
        "batch_size": args.batch_size,
        "shuffle": True,
        "seed": args.seed,
        "num_threads": args.threads,
    }
    if variant == "single":
        return ShardLoader(data["C"]["uri"], **common)
    # ``MixedLoader`` is what ``ShardLoader.mix`` made (when it has one).
    return MixedLoader(
        [(data["A"]["uri"], args.split), (data["B"]["uri"], 1 - args.split)],
        samples_per_epoch=data["C"]["rows"],
        **common,
    )


def run_epoch(loader: Any, epoch: int, classes: int) -> tuple[int, list[int]]:
    """Epoch ``epoch`` of ``loader``: its images and label histogram."""
    loader.set_epoch(epoch)
    n, hist = 0, torch.zeros(classes, dtype=torch.int64)
    for _images, labels in loader:
        n += len(labels)
        hist += torch.bincount(labels, minlength=classes)
    return n, hist.tolist()


def epoch_images(variant: str, data: dict[str, dict[str, Any]], args: argparse.Namespace) -> Counter:
    """Epoch 0 of a new loader of ``variant`` as a multiset of (image digest, label)."""
    out: Counter = Counter()
    with make_loader(variant, data, args) as loader:
        loader.set_epoch(0)
        for images, labels in loader:
            for image, label in zip(images, labels.tolist()):
                digest = hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).digest()
                out[digest, label] += 1
    return out


def run(variant: str, data: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """A new loader of ``variant``: one warm-up epoch, then ``args.epochs`` timed ones."""
    gc.collect()
    with make_loader(variant, data, args) as loader:
        warm_n, _ = run_epoch(loader, 0, args.classes)
        epochs = []
        with other_load() as others:
            cpu0, t0 = time.process_time(), time.perf_counter()
            for e in range(1, args.epochs + 1):
                c, t = time.process_time(), time.perf_counter()
                n, hist = run_epoch(loader, e, args.classes)
                epoch = {"images": n, "seconds": time.perf_counter() - t, "cpu_s": time.process_time() - c}
                epoch["labels"] = hist
                if variant == "mix":
                    epoch["source_rows"] = list(loader.source_rows)
                epochs.append(epoch)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        threads = loader.options.num_threads  # one pool of decode threads, a mixture's too
    images = sum(e["images"] for e in epochs)
    return {
        "variant": variant,
        "warmup_images": warm_n,
        "images": images,
        "seconds": seconds,
        "cpu_s": cpu,
        "images_per_s": images / seconds,
        "cpu_ms_per_image": 1e3 * cpu / images,
        "decode_threads": threads,
        "other_cpu_share": others(),
        "epochs": epochs,
    }


# -- the report -------------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    out: dict[str, Any] = {}
    for v, rs in by.items():
        rates = [r["images_per_s"] for r in rs]
        cpus = [r["cpu_ms_per_image"] for r in rs]
        per_epoch = sorted({e["images"] for r in rs for e in r["epochs"]})
        out[v] = {
            "images_per_s_median": statistics.median(rates),
            "cpu_ms_per_image_median": statistics.median(cpus),
            "images_per_s": rates,
            "cpu_ms_per_image": cpus,
            "images_per_epoch": per_epoch[0] if len(per_epoch) == 1 else per_epoch,
            "other_cpu_share_median": statistics.median(r["other_cpu_share"] for r in rs),
        }
    single, mix = out["single"], out["mix"]
    for v in VARIANTS:
        out[v]["rate_ratio_to_single"] = out[v]["images_per_s_median"] / single["images_per_s_median"]
        out[v]["cpu_ratio_to_single"] = out[v]["cpu_ms_per_image_median"] / single["cpu_ms_per_image_median"]
    for key in ("images_per_s", "cpu_ms_per_image"):
        name = "rate_ratio_paired" if key == "images_per_s" else "cpu_ratio_paired"
        mix[name] = paired((m[key] for m in by["mix"]), (s[key] for s in by["single"]))
    rates = single["images_per_s"]
    spread = (max(rates) - min(rates)) / statistics.median(rates)
    labels = {v: [e["labels"] for r in by[v] for e in r["epochs"]] for v in VARIANTS}
    out["single_spread"] = spread
    out["same_count_per_epoch"] = single["images_per_epoch"] == mix["images_per_epoch"]
    out["same_labels_per_epoch"] = all(a == labels["single"][0] for a in labels["single"] + labels["mix"])
    noise = max(spread, NOISE_FLOOR)
    out["noise"] = noise
    out["within_noise"] = abs(mix["rate_ratio_to_single"] - 1) <= noise
    return out


def print_table(summary: dict[str, Any]) -> None:
    print()
    print(
        f"{'variant':<8} {'images/s':>10} {'CPU ms/image':>13} {'rate ratio':>11} {'CPU ratio':>10} "
        f"{'others CPU':>11}"
    )
    for v in VARIANTS:
        s = summary[v]
        print(
            f"{v:<8} {s['images_per_s_median']:>10.0f} {s['cpu_ms_per_image_median']:>13.3f} "
            f"{s['rate_ratio_to_single']:>11.3f} {s['cpu_ratio_to_single']:>10.3f} "
            f"{s['other_cpu_share_median']:>11.1%}"
        )
    mix = summary["mix"]
    print(
        f"\nmix / single, paired (median of each repeat's ratio): images/s {mix['rate_ratio_paired']:.3f}, "
        f"CPU/image {mix['cpu_ratio_paired']:.3f}"
    )
    print(
        f"images per epoch: single {summary['single']['images_per_epoch']}, mix {mix['images_per_epoch']}; "
        f"same labels every epoch: {summary['same_labels_per_epoch']}"
    )
    busy = max(summary[v]["other_cpu_share_median"] for v in VARIANTS)
    if busy > BUSY:
        print(
            f"warning: other processes took {busy:.0%} of the machine's CPU during the runs: the rates are "
            "unreliable (CPU per image less so); rerun on a quiet machine"
        )
    verdict = "within" if summary["within_noise"] else "OUTSIDE"
    print(
        f"mix is {verdict} noise of single: |ratio - 1| = {abs(mix['rate_ratio_to_single'] - 1):.3f} "
        f"vs noise {summary['noise']:.3f} (single's spread {summary['single_spread']:.3f}, floor {NOISE_FLOOR})"
    )


# -- the command line -------------------------------------------------------------------------------
def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be strictly between 0 and 1")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Variants, datasets and what is measured: benchmarks/README.md.",
    )
    parser.add_argument(
        "--images",
        type=positive,
        help=f"images in C (A and B split them); a multiple of --batch-size (default {DEFAULTS['images']})",
    )
    parser.add_argument(
        "--split", type=_fraction, default=0.7, help="A's share of the images and weight (default 0.7)"
    )
    parser.add_argument("--size", type=positive, default=224, help="image size in px (default 224)")
    parser.add_argument("--quality", type=positive, default=90, help="JPEG quality (default 90)")
    parser.add_argument("--classes", type=positive, default=10, help="label classes (default 10)")
    parser.add_argument("--batch-size", type=positive, default=64, help="default 64")
    parser.add_argument(
        "--threads",
        type=positive,
        help="decode threads of each variant (the mixture shares them out by weight; default: one per core)",
    )
    parser.add_argument(
        "--torch-threads",
        type=positive,
        help="torch.set_num_threads before the runs (default: torch's own; the mixture joins its "
        "sources' rows with torch.cat, which uses them)",
    )
    parser.add_argument("--seed", type=int, default=7, help="the loaders' shuffle seed (default 7)")
    parser.add_argument(
        "--epochs",
        type=positive,
        help=f"timed epochs per run, after one warm-up (default {DEFAULTS['epochs']})",
    )
    parser.add_argument(
        "--repeats",
        type=positive,
        help=f"runs of each variant, alternating (default {DEFAULTS['repeats']})",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="a smoke run: " + ", ".join(f"--{k} {v}" for k, v in SMALL.items()) + " unless given",
    )
    parser.add_argument(
        "--workdir", help="where to build (and keep) the datasets (default: a temporary folder)"
    )
    parser.add_argument("--out", default="mix_bench.json", help="JSON results (default mix_bench.json)")
    args = parser.parse_args(argv)
    for key, value in {**DEFAULTS, **(SMALL if args.small else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads is None:
        args.threads = default_threads()
    if not 1 <= args.quality <= 100:
        parser.error(f"--quality must be in [1, 100], got {args.quality}")
    if args.images % args.batch_size:
        parser.error(
            f"--images ({args.images}) must be a multiple of --batch-size ({args.batch_size}): "
            "a mixture's epoch is whole batches"
        )
    rows_a, rows_b = shares([args.split, 1 - args.split], args.images)
    if not (rows_a and rows_b):
        parser.error(
            f"--split {args.split} of {args.images} images leaves a dataset empty ({rows_a} + {rows_b})"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    with work_folder(args.workdir, prefix="mix-bench-") as work:
        data = build(work, args)
        for name, d in data.items():
            print(
                f"{name}: {d['rows']} images, {d['mean_jpeg_bytes'] / 1e3:.1f} kB each, version {d['dataset_version']}"
            )
        # Untimed: the mixture's epoch holds exactly the single dataset's (image, label) pairs.
        same_images = epoch_images("single", data, args) == epoch_images("mix", data, args)
        print(
            f"epoch 0: the mixture yields the same (image, label) pairs as the single dataset: {same_images}"
        )
        runs = []
        for r in range(args.repeats):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                result = run(variant, data, args)
                result["repeat"] = r
                result["position"] = order.index(variant)
                runs.append(result)
                print(
                    f"repeat {r + 1}/{args.repeats} {variant:<6}: {result['images_per_s']:7.0f} images/s, "
                    f"{result['cpu_ms_per_image']:.3f} CPU ms/image ({result['images']} images, "
                    f"{result['seconds']:.2f} s, threads {result['decode_threads']})",
                    flush=True,
                )
    summary = summarize(runs)
    summary["same_images_epoch0"] = same_images
    print_table(summary)
    config = {k: v for k, v in vars(args).items() if k not in ("out",)}
    result = {
        "benchmark": "mix_bench",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "datasets": data,
        "summary": summary,
        "runs": runs,
    }
    print()
    write_out(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
