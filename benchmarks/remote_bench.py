"""How fast does ShardLoader stream a shard from object storage, against the same shard on local disk?

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "Loader from
object storage".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import json_child, log_to_stdout, positive, work_folder, write_out
from _data import PHOTO_QUALITY, build_dataset, photo_image, synthetic_image
from _timing import alternate, other_load, parse_variant, procs_cpu_s
from emulated_store import Azurite, AzuriteMissingError, connection_string, find_azurite
from loader_bench import epoch_timing
from remote_store import NginxMissingError, RemoteStore, Traffic, find_nginx, parse_rate

from lakeshard import storage
from lakeshard.format import shard_relpath
from loaders import ShardLoader
from loaders.options import OPTIONS

log = logging.getLogger("remote_bench")

#: ``--profile``: (latency in ms, bandwidth per connection).
PROFILES = {"near": (20.0, "80MB"), "far": (100.0, "25MB")}
SOURCES = ("local", "remote")
#: Whose CPU seconds each epoch records (:func:`cpu_now`).
CPU_OF = ("loader", "store_server", "shim")


class Served(NamedTuple):
    """A store the remote source reads: the latency shim (``store``, its traffic), the dataset's
    URI there, and the processes serving the bytes behind the shim (nginx, an emulator), whose
    CPU the benchmark records beside the loader's."""

    store: RemoteStore
    uri: str
    server_pids: tuple[int, ...]


@contextlib.contextmanager
def s3_store(work: Path, dataset: Path, args: argparse.Namespace) -> Iterator[Served]:
    """nginx serving ``work`` as ``s3://bench/``, behind the latency shim."""
    with RemoteStore(work, latency_ms=args.latency_ms, bandwidth=args.bandwidth_bytes) as store:
        os.environ.update(store.environ())
        yield Served(store, store.uri(dataset.name), tuple(p for p in store.pids if p not in store.shim_pids))


def _copy_to(bucket: str, work: Path, dataset: Path) -> None:
    """Copy ``dataset`` (a folder under ``work``) to ``bucket`` (``gs://bench``), straight to the
    emulator: the shim, started after, counts none of it."""
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        storage.write_bytes_atomic(f"{bucket}/{path.relative_to(work).as_posix()}", path.read_bytes())


@contextlib.contextmanager
def gcs_store(work: Path, dataset: Path, args: argparse.Namespace) -> Iterator[Served]:
    """The GCS emulator of the tests (``tests/helpers/gcs_emulator.py``: in memory, with the
    JSON API's generation headers and suffix ranges) holding the dataset in ``gs://bench/``,
    behind the same latency shim."""
    from tests.helpers.gcs_emulator import start_emulator

    emulator = start_emulator()
    try:
        os.environ.update(STORAGE_EMULATOR_HOST=emulator.endpoint, GOOGLE_CLOUD_PROJECT="bench")
        storage.gcs_client().create_bucket("bench")
        _copy_to("gs://bench", work, dataset)
        with RemoteStore(
            work, latency_ms=args.latency_ms, bandwidth=args.bandwidth_bytes, upstream=emulator.endpoint
        ) as store:
            os.environ["STORAGE_EMULATOR_HOST"] = store.endpoint
            yield Served(store, f"gs://bench/{dataset.name}", (emulator.process.pid,))
    finally:
        emulator.stop()


@contextlib.contextmanager
def azure_store(work: Path, dataset: Path, args: argparse.Namespace) -> Iterator[Served]:
    """Azurite (``benchmarks/emulated_store.py``: in memory) holding the dataset in
    ``az://bench/``, behind the same latency shim."""
    azurite = Azurite().start()
    try:
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(azurite.endpoint)
        storage.azure_client().create_container("bench")
        _copy_to("az://bench", work, dataset)
        with RemoteStore(
            work, latency_ms=args.latency_ms, bandwidth=args.bandwidth_bytes, upstream=azurite.endpoint
        ) as store:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(store.endpoint)
            yield Served(store, f"az://bench/{dataset.name}", (azurite.pid,) if azurite.pid else ())
    finally:
        azurite.stop()


#: ``--store``: what serves the remote source, by name.
STORES = {"s3": s3_store, "gcs": gcs_store, "azure": azure_store}


def loader_options(texts: list[str]) -> dict[str, Any]:
    """``--loader-option key=value[,key=value]`` as ShardLoader keyword arguments (integers as
    int, ``none`` as None, ``true``/``false`` as bool); a key ShardLoader does not take is an
    ``ArgumentTypeError`` naming it."""
    known = list(OPTIONS)
    out: dict[str, Any] = {}
    for text in texts:
        try:
            parsed = parse_variant(text, known, "ShardLoader")
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(
                f"--loader-option: {exc} (it takes: {', '.join(known)})"
            ) from None
        out.update(
            {
                k: {"true": True, "false": False}.get(v, v) if isinstance(v, str) else v
                for k, v in parsed.items()
            }
        )
    return out


#: Seconds a new process may take for its first batch (:data:`_FIRST_BATCH`), imports included.
_PROCESS_TIMEOUT_S = 300

#: A new process's first batch, as a training script's comes: ``torch`` and ``loaders``
#: imported, then the clock started at ``ShardLoader(...)`` (every client, connection and lazily
#: imported module the loader needs still to make). Arguments: the repository root, the dataset
#: and the loader's keyword arguments as JSON; prints ``{"first_batch_s", "constructor_s"}``.
_FIRST_BATCH = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from loaders import ShardLoader
start = time.perf_counter()
loader = ShardLoader(sys.argv[2], **json.loads(sys.argv[3]))
made = time.perf_counter()
batches = iter(loader)
try:
    next(batches)
    first = time.perf_counter() - start
finally:
    batches.close()
    loader.close()
print(json.dumps({"first_batch_s": first, "constructor_s": made - start}))
"""


def new_loader(dataset: str, args: argparse.Namespace) -> ShardLoader:
    return ShardLoader(dataset, **loader_kwargs(args))


def loader_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"channel": "train", "batch_size": args.batch_size, "shuffle": True, "seed": 0, **args.options}


def process_first_batch(dataset: str, args: argparse.Namespace) -> dict[str, float]:
    """:data:`_FIRST_BATCH` in a new process (this one's environment: the store's endpoint)."""
    root = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, "-c", _FIRST_BATCH, root, dataset, json.dumps(loader_kwargs(args))]
    return json_child(cmd, f"a new process's first batch from {dataset}", timeout=_PROCESS_TIMEOUT_S)


def cpu_now(served: Served) -> dict[str, float]:
    """CPU seconds used so far by this process (the loader), the store's server processes
    (nginx and its workers, or the emulator) and the latency shim."""
    return {
        "loader": time.process_time(),
        "store_server": procs_cpu_s(served.server_pids),
        "shim": procs_cpu_s(served.store.shim_pids),
    }


def measure(source: str, dataset: str, args: argparse.Namespace, served: Served) -> dict[str, Any]:
    """One repeat of one source: the kept loader's epochs, then a fresh loader's first batch."""
    remote, store = source == "remote", served.store
    out: dict[str, Any] = {}
    loader = new_loader(dataset, args)
    try:
        for e in range(args.epochs):
            before, logged, cpu = store.traffic(), len(store.served()), cpu_now(served)
            n = e + 1  # epoch_timing runs the next epoch: set_epoch(e + 1)
            rate, first, out["images"], gap = epoch_timing(dataset, args, loader)
            out |= {f"epoch{n}": rate, f"epoch{n}_first_batch_s": first, f"epoch{n}_gap_s": gap}
            out[f"epoch{n}_cpu_s"] = {k: v - cpu[k] for k, v in cpu_now(served).items()}
            if remote:
                out[f"epoch{n}_traffic"] = (store.traffic() - before).as_dict()
                out[f"epoch{n}_served"] = store.served(since=logged)
    finally:
        loader.close()
    if remote:  # a new process has no store clients (nor their connections)
        storage.clear_s3_clients()
        storage.clear_gcs_clients()
        storage.clear_azure_clients()
    before, logged = store.traffic(), len(store.served())
    start = time.perf_counter()
    fresh = new_loader(dataset, args)
    # The iterator is held until the clock stops: dropping it is a ``break`` out of the loop,
    # which stops the epoch (and waits for its reader), no part of the wait for a first batch.
    batches = iter(fresh)
    try:
        next(batches)
        out["fresh_first_batch_s"] = time.perf_counter() - start
    finally:
        batches.close()
        fresh.close()
    if remote:
        out["fresh_first_batch_traffic"] = (store.traffic() - before).as_dict()
        out["fresh_first_batch_served"] = store.served(since=logged)
    return out


def measure_process(
    source: str, dataset: str, args: argparse.Namespace, store: RemoteStore
) -> dict[str, Any]:
    """A new process's first batch (:func:`process_first_batch`), and for the remote what the
    store served it. Run outside :func:`_timing.other_load`: the child is no other load."""
    before = store.traffic()
    child = process_first_batch(dataset, args)
    out = {"process_first_batch_s": child["first_batch_s"], "process_constructor_s": child["constructor_s"]}
    if source == "remote":
        out["process_first_batch_traffic"] = (store.traffic() - before).as_dict()
    return out


def check_same_batches(local: str, remote: str, args: argparse.Namespace) -> None:
    """The first batch of epoch 0 from both sources must be the same tensors."""
    a, b = new_loader(local, args), new_loader(remote, args)
    try:
        (xa, ya), (xb, yb) = next(iter(a)), next(iter(b))
    finally:
        a.close()
        b.close()
    if not (torch.equal(xa, xb) and torch.equal(ya, yb)):
        raise SystemExit(
            "remote_bench: error: the loader's first batch differs between local disk and the store"
        )
    log.info("first batch: identical from local disk and from the store")


def bounds(
    med: dict[str, float], traffic: dict[str, float], images: int, latency_ms: float, bandwidth: int
) -> dict[str, float]:
    """Seconds an epoch needs for each cause alone: the bytes at one connection's bandwidth,
    the requests one after another at the latency, the decode (the local epoch)."""
    return {
        "bytes_at_one_connection_s": traffic["body_bytes"] / bandwidth,
        "requests_in_sequence_s": traffic["requests"] * latency_ms / 1000,
        "local_epoch_s": images / med["local"],
        "remote_epoch_s": images / med["remote"],
    }


def summarize(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, images: int) -> dict[str, Any]:
    def median(source: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[source])

    def median_traffic(key: str) -> dict[str, float]:
        return {
            f.name: statistics.median(r[key][f.name] for r in runs["remote"])
            for f in dataclasses.fields(Traffic)
        }

    epochs = []
    for e in range(1, args.epochs + 1):
        med = {s: median(s, f"epoch{e}") for s in SOURCES}
        first = {s: median(s, f"epoch{e}_first_batch_s") for s in SOURCES}
        gap = {s: median(s, f"epoch{e}_gap_s") for s in SOURCES}
        traffic = median_traffic(f"epoch{e}_traffic")
        cpu = {
            s: {k: statistics.median(r[f"epoch{e}_cpu_s"][k] for r in runs[s]) for k in CPU_OF}
            for s in SOURCES
        }
        epochs.append(
            {
                "epoch": e,
                "images_per_s": med,
                "cpu_s": cpu,
                "first_batch_s": first,
                "typical_gap_s": gap,
                "traffic": traffic,
                "bounds_s": bounds(med, traffic, images, args.latency_ms, args.bandwidth_bytes),
            }
        )
    fresh = {s: median(s, "fresh_first_batch_s") for s in SOURCES}
    process = {s: median(s, "process_first_batch_s") for s in SOURCES}
    constructor = {s: median(s, "process_constructor_s") for s in SOURCES}
    return {
        "epochs": epochs,
        "fresh_first_batch_s": fresh,
        "fresh_first_batch_traffic": median_traffic("fresh_first_batch_traffic"),
        "process_first_batch_s": process,
        "process_constructor_s": constructor,
        "process_first_batch_traffic": median_traffic("process_first_batch_traffic"),
        "other_cpu_share": {s: median(s, "other_cpu_share") for s in SOURCES},
    }


def print_table(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"remote ({args.store}): {args.latency_ms:g} ms before each response, {args.bandwidth_bytes / 1e6:g} MB/s per connection; "
        f"medians of {args.repeats} repeats"
    )
    print(
        f"{'epoch':>5s} {'local img/s':>12s} {'remote img/s':>13s} {'ratio':>6s} {'1st batch local':>16s} "
        f"{'remote':>7s} {'gap local':>10s} {'remote':>7s} {'requests':>9s} {'GET/HEAD/LIST':>14s} {'conns':>6s} {'MB served':>10s}   "
        f"{'bound: MB/bw':>12s} {'req x lat':>10s} {'decode':>7s} {'epoch':>7s}"
    )
    for e in summary["epochs"]:
        r, f, t, b, g = e["images_per_s"], e["first_batch_s"], e["traffic"], e["bounds_s"], e["typical_gap_s"]
        print(
            f"{e['epoch']:5d} {r['local']:12.0f} {r['remote']:13.0f} {r['remote'] / r['local']:6.2f} "
            f"{f['local']:15.3f}s {f['remote']:6.3f}s {g['local']:9.3f}s {g['remote']:6.3f}s {t['requests']:9.0f} "
            f"{t['gets']:>6.0f}/{t['heads']:.0f}/{t['lists']:.0f} {t['connections']:6.0f} {t['body_bytes'] / 1e6:10.1f}   "
            f"{b['bytes_at_one_connection_s']:11.2f}s {b['requests_in_sequence_s']:9.2f}s {b['local_epoch_s']:6.2f}s "
            f"{b['remote_epoch_s']:6.2f}s"
        )
    fresh, t = summary["fresh_first_batch_s"], summary["fresh_first_batch_traffic"]
    print(
        f"fresh loader, first batch (constructor included): local {fresh['local']:.3f}s, remote {fresh['remote']:.3f}s "
        f"({t['requests']:.0f} requests: {t['gets']:.0f} GET, {t['heads']:.0f} HEAD, {t['lists']:.0f} LIST; "
        f"{t['connections']:.0f} connections; {t['body_bytes'] / 1e6:.1f} MB)"
    )
    process, made, t = (
        summary["process_first_batch_s"],
        summary["process_constructor_s"],
        summary["process_first_batch_traffic"],
    )
    print(
        f"new process, first batch (constructor included; imports done): local {process['local']:.3f}s, "
        f"remote {process['remote']:.3f}s (constructor {made['local']:.3f}s, {made['remote']:.3f}s; "
        f"{t['requests']:.0f} requests, {t['connections']:.0f} connections)"
    )
    server = {"s3": "nginx", "gcs": "gcp-storage-emulator", "azure": "Azurite"}[args.store]
    for e in summary["epochs"]:
        c = e["cpu_s"]
        print(
            f"epoch {e['epoch']} CPU s: loader local {c['local']['loader']:.2f}, remote {c['remote']['loader']:.2f}; "
            f"store's server ({server}) {c['remote']['store_server']:.2f} (idle during the local epoch: "
            f"{c['local']['store_server']:.2f}); latency shim {c['remote']['shim']:.2f}"
        )
    busy = summary["other_cpu_share"]
    print(
        f"CPU taken by others meanwhile: {busy['local']:.0%} of the machine (local runs), {busy['remote']:.0%} (remote runs; "
        "the store's own nginx and shim count here)"
    )


def prepare(args: argparse.Namespace, work: Path) -> Path:
    """The synthetic dataset under ``work`` (reused when a run with the same settings built it)."""
    kind = "photo" if args.photo else "plain"
    dataset = work / f"ds-{kind}-{args.images}-{args.size}-q{args.quality}"
    if not (dataset / "dataset.json").exists():
        log.info("building %d synthetic %dpx JPEGs (%s) in %s", args.images, args.size, kind, dataset)
        build_dataset(
            dataset,
            images=args.images,
            size=args.size,
            quality=args.quality,
            image=photo_image if args.photo else synthetic_image,
        )
    return dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=positive, default=4000, help="images in the synthetic dataset")
    parser.add_argument("--size", type=positive, default=224, help="image size of the synthetic dataset")
    parser.add_argument(
        "--quality", type=int, help=f"JPEG quality (default 90; {PHOTO_QUALITY} with --photo)"
    )
    parser.add_argument(
        "--photo", action="store_true", help="noisier images, ~100 kB each at 224px (see photo_image)"
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="near",
        help="; ".join(f"{k}: {v[0]:g} ms, {v[1]}/s" for k, v in PROFILES.items()),
    )
    parser.add_argument(
        "--latency-ms", type=float, help="before each response's first byte (default: the profile's)"
    )
    parser.add_argument(
        "--bandwidth",
        help="per connection, per second, e.g. 80MB (decimal) or 64MiB (default: the profile's)",
    )
    parser.add_argument("--batch-size", type=positive, default=64)
    parser.add_argument("--epochs", type=positive, default=3, help="epochs of the kept loader per repeat")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument(
        "--loader-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a ShardLoader keyword argument for both sources (repeatable)",
    )
    parser.add_argument(
        "--workdir", help="where to build (and keep) the synthetic dataset (default: a temporary folder)"
    )
    parser.add_argument(
        "--store",
        choices=sorted(STORES),
        default="s3",
        help="the remote store behind the shim: s3 (nginx, S3's protocol), gcs (the GCS emulator) or azure (Azurite)",
    )
    parser.add_argument("--out", default="remote_bench.json", help="JSON results")
    args = parser.parse_args(argv)
    latency, bandwidth = PROFILES[args.profile]
    args.latency_ms = latency if args.latency_ms is None else args.latency_ms
    args.quality = args.quality or (PHOTO_QUALITY if args.photo else 90)
    try:
        args.bandwidth_bytes = parse_rate(args.bandwidth or bandwidth)
        args.options = loader_options(args.loader_option)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    if args.latency_ms < 0:
        parser.error(f"--latency-ms must be >= 0, got {args.latency_ms:g}")
    try:
        if args.store == "s3":
            find_nginx()
        elif args.store == "azure":
            find_azurite()
    except (NginxMissingError, AzuriteMissingError) as exc:
        parser.error(str(exc))
    log_to_stdout()
    logging.getLogger("azure").setLevel(logging.WARNING)  # the Azure SDK logs every request at INFO

    with work_folder(args.workdir) as work:
        dataset = prepare(args, work)
        with STORES[args.store](work, dataset, args) as served:
            store, sources = served.store, {"local": str(dataset), "remote": served.uri}
            check_same_batches(sources["local"], sources["remote"], args)
            for source in SOURCES:  # warm the page cache and the imports (boto's, the decoders')
                new_loader(sources[source], args).close()
            shard = (dataset / shard_relpath("train", 0, 1)).stat().st_size
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SOURCES}
            for r in range(args.repeats):
                for source in alternate(SOURCES, r):
                    with other_load() as busy:
                        runs[source].append(measure(source, sources[source], args, served))
                    runs[source][-1]["other_cpu_share"] = busy()
                    runs[source][-1].update(measure_process(source, sources[source], args, store))
                log.info("repeat %d/%d done", r + 1, args.repeats)
            total, pids = store.traffic(), store.pids

    images = runs["local"][0]["images"]
    summary = summarize(runs, args, images)
    print(f"{images} images, {shard / 1e6:.1f} MB train shard ({shard / images / 1e3:.1f} kB an image)")
    print_table(summary, args)
    result = {
        "args": vars(args),
        "cpu_count": os.cpu_count(),
        "images": images,
        "shard_bytes": shard,
        "latency_ms": args.latency_ms,
        "bandwidth_bytes_per_s": args.bandwidth_bytes,
        "summary": summary,
        "runs": runs,
        "store_total": total.as_dict(),
        "store_pids": pids,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    write_out(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
