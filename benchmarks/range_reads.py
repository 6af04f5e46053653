"""The loader's hand-written ranged reads against well-kept libraries, on the remote-like store.

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "The ranged-read
stack against libraries".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import importlib.util
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _data
from _cli import log_to_stdout, work_folder, write_out
from remote_store import NginxMissingError, RemoteStore, find_nginx, parse_rate

from lakeshard import storage
from lakeshard.format import read_shard_footer, shard_relpath
from loaders._internal.fetch import ByteRange, RangeFetcher, read_range, read_row_group, row_group_range

log = logging.getLogger("range_reads")

#: The columns each row group is decoded into (what the loader reads of a shard).
COLUMNS = ["image", "label"]


@dataclass(frozen=True)
class Shard:
    """The shard as every variant sees it: where it is, its footer and its ETag."""

    path: Path  # on disk (the truth each variant's bytes are checked against)
    bucket: str
    key: str
    metadata: pq.FileMetaData
    size: int
    etag: str
    ranges: list[tuple[int, int]]  # each row group's bytes

    def decode(self, g: int, data: Any) -> pa.Table:
        """Row group ``g``'s columns from its fetched bytes ``data``."""
        return read_row_group(self.metadata, self.size, g, self.ranges[g][0], data, COLUMNS)


def table_digest(table: pa.Table) -> str:
    """A digest of a decoded row group's values (the images' bytes and the labels)."""
    h = hashlib.sha256()
    for value in table.column("image").to_pylist():
        h.update(len(value).to_bytes(8, "little"))
        h.update(value)
    h.update(np.asarray(table.column("label").to_numpy(), dtype=np.int64).tobytes())
    return h.hexdigest()


def epoch_order(groups: int, seed: int, epoch: int) -> list[int]:
    """The row groups of an epoch in a seeded random order (the same for every variant)."""
    return [int(g) for g in np.random.default_rng([seed, epoch]).permutation(groups)]


def windows(order: list[int], n: int) -> Iterator[list[int]]:
    for i in range(0, len(order), n):
        yield order[i : i + n]


# -- the variants: each ``make(shard, store, args)`` returns ``read(order) -> [(group, table, raw)]``
#    (``raw``: the fetched bytes, or ``None`` where the library hands back a table only) -------------
Read = Callable[[list[int]], list[tuple[int, pa.Table, Any]]]


def make_lakeshard(shard: Shard, store: RemoteStore, args: argparse.Namespace) -> Read:
    storage.clear_s3_clients()  # a new client and new connections, as a new process has
    storage.s3_client()  # made by the loader's constructor, before any read
    return _fetcher_read(shard, args, functools.partial(read_range, storage.S3Store()))


def _fetcher_read(
    shard: Shard, args: argparse.Namespace, read_range: Callable[[ByteRange, Any, Any], Any]
) -> Read:
    """The loader's :class:`RangeFetcher` (schedule order, ``--concurrency`` threads, a byte
    budget of that many row groups) over ``read_range``, each row group decoded as it is taken."""
    budget = args.concurrency * max(hi - lo for lo, hi in shard.ranges)
    fetcher = RangeFetcher(read_range, concurrency=args.concurrency, budget=budget, name="bench")
    fetcher.start()
    stop, uri = threading.Event(), f"s3://{shard.bucket}/{shard.key}"

    def read(order: list[int]) -> list[tuple[int, pa.Table, Any]]:
        ranges = {g: ByteRange(uri, *shard.ranges[g], shard.etag) for g in order}
        fetcher.schedule([(g, ranges[g]) for g in order])
        out = []
        for g in order:
            data = fetcher.get(g, stop)
            out.append((g, shard.decode(g, data), data))
            fetcher.release(g)
        return out

    read.close = fetcher.close  # type: ignore[attr-defined]
    return read


def _credentials(store: RemoteStore) -> dict[str, str]:
    """The store's endpoint and dummy credentials, named as obstore and OpenDAL take them."""
    env = store.environ()
    return {
        "endpoint": env["AWS_ENDPOINT_URL"],
        "region": env["AWS_REGION"],
        "access_key_id": env["AWS_ACCESS_KEY_ID"],
        "secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
    }


def _obstore(shard: Shard, store: RemoteStore) -> Any:
    from obstore.store import S3Store

    http = {"virtual_hosted_style_request": False, "client_options": {"allow_http": True}}
    return S3Store(shard.bucket, **_credentials(store), **http)


def make_obstore(shard: Shard, store: RemoteStore, args: argparse.Namespace) -> Read:
    import obstore

    s3 = _obstore(shard, store)

    def read(order: list[int]) -> list[tuple[int, pa.Table, Any]]:
        out = []
        for window in windows(order, args.concurrency):
            got = obstore.get_ranges(
                s3,
                shard.key,
                starts=[shard.ranges[g][0] for g in window],
                ends=[shard.ranges[g][1] for g in window],
            )
            out += [(g, shard.decode(g, data), data) for g, data in zip(window, got, strict=True)]
        return out

    return read


async def _in_order(
    order: list[int], concurrency: int, fetch: Callable[[int], Any], decode: Callable[[int, Any], pa.Table]
) -> list[tuple[int, pa.Table, Any]]:
    """``fetch(g)`` of every group, at most ``concurrency`` at once, started in ``order``; each
    result decoded in ``order`` as it comes."""
    gate = asyncio.Semaphore(concurrency)

    async def one(g: int) -> Any:
        async with gate:
            return await fetch(g)

    tasks = [asyncio.ensure_future(one(g)) for g in order]
    out = []
    for g, task in zip(order, tasks, strict=True):
        data = await task
        out.append((g, decode(g, data), data))
    return out


def make_fetcher_obstore(shard: Shard, store: RemoteStore, args: argparse.Namespace) -> Read:
    import obstore

    s3 = _obstore(shard, store)

    def read_range(r: ByteRange, pool: Any = None, stats: Any = None) -> Any:
        return obstore.get(s3, shard.key, options={"range": (r.start, r.end), "if_match": r.etag}).bytes()

    return _fetcher_read(shard, args, read_range)


def _opendal(shard: Shard, store: RemoteStore, kind: str = "Operator") -> Any:
    import opendal

    local = {"disable_config_load": "true", "disable_ec2_metadata": "true"}
    return getattr(opendal, kind)("s3", bucket=shard.bucket, **_credentials(store), **local)


def make_fetcher_opendal(shard: Shard, store: RemoteStore, args: argparse.Namespace) -> Read:
    op = _opendal(shard, store)

    def read_range(r: ByteRange, pool: Any = None, stats: Any = None) -> Any:
        return op.read(shard.key, offset=r.start, size=r.size, if_match=r.etag)

    return _fetcher_read(shard, args, read_range)


def make_obstore_async(shard: Shard, store: RemoteStore, args: argparse.Namespace) -> Read:
    import obstore

    s3 = _obstore(shard, store)

    async def fetch(g: int) -> Any:
        got = await obstore.get_async(
            s3, shard.key, options={"range": shard.ranges[g], "if_match": shard.etag}
        )
        return await got.bytes_async()

    return lambda order: asyncio.run(_in_order(order, args.concurrency, fetch, shard.decode))


def make_pyarrow(shard: Shard, store: RemoteStore, args: argparse.Namespace) -> Read:
    import pyarrow.fs as pafs

    pa.set_io_thread_count(args.concurrency)
    env = store.environ()
    fs = pafs.S3FileSystem(
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_REGION"],
        endpoint_override=env["AWS_ENDPOINT_URL"].removeprefix("http://"),
        scheme="http",
    )
    # The footer is known (given as metadata, as the loader reads it once); opening costs a HEAD.
    pf = pq.ParquetFile(
        fs.open_input_file(f"{shard.bucket}/{shard.key}"), metadata=shard.metadata, pre_buffer=True
    )

    def read(order: list[int]) -> list[tuple[int, pa.Table, Any]]:
        out = []
        for window in windows(order, args.concurrency):
            table = pf.read_row_groups(window, columns=COLUMNS, use_threads=True)
            at = 0
            for g in window:
                rows = shard.metadata.row_group(g).num_rows
                out.append((g, table.slice(at, rows), None))
                at += rows
        return out

    return read


def make_opendal_async(shard: Shard, store: RemoteStore, args: argparse.Namespace) -> Read:
    op = _opendal(shard, store, "AsyncOperator")

    async def fetch(g: int) -> Any:
        lo, hi = shard.ranges[g]
        return await op.read(shard.key, offset=lo, size=hi - lo, if_match=shard.etag)

    return lambda order: asyncio.run(_in_order(order, args.concurrency, fetch, shard.decode))


#: Each variant: the package it needs (``None``: the project's own) and what makes its reader.
VARIANTS: dict[str, tuple[str | None, Callable[[Shard, RemoteStore, argparse.Namespace], Read]]] = {
    "lakeshard": (None, make_lakeshard),
    "obstore": ("obstore", make_obstore),
    "obstore-async": ("obstore", make_obstore_async),
    "fetcher+obstore": ("obstore", make_fetcher_obstore),
    "pyarrow": ("pyarrow", make_pyarrow),
    "opendal-async": ("opendal", make_opendal_async),
    "fetcher+opendal": ("opendal", make_fetcher_opendal),
}


# -- measuring -----------------------------------------------------------------------------------
def check(
    name: str, shard: Shard, got: list[tuple[int, pa.Table, Any]], truth: dict[int, tuple[bytes, str]]
) -> None:
    """Every row group's bytes (where the variant returns them) are the file's, and its decoded
    table is the one decoded from them."""
    if sorted(g for g, _, _ in got) != sorted(truth):
        raise AssertionError(
            f"{name}: read row groups {sorted(g for g, _, _ in got)}, not each of {sorted(truth)} once"
        )
    for g, table, raw in got:
        raw_truth, digest = truth[g]
        if raw is not None and bytes(raw) != raw_truth:
            raise AssertionError(f"{name}: row group {g}: bytes differ from the file's")
        if table_digest(table) != digest:
            raise AssertionError(f"{name}: row group {g}: decoded values differ from the file's")


def measure(
    name: str,
    shard: Shard,
    store: RemoteStore,
    args: argparse.Namespace,
    repeat: int,
    truth: dict[int, tuple[bytes, str]],
) -> dict[str, Any]:
    """One repeat of one variant: its setup, then ``--epochs`` epochs."""
    before = store.traffic()
    t0, c0 = time.perf_counter(), time.process_time()
    read = VARIANTS[name][1](shard, store, args)
    run: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "setup_cpu_s": time.process_time() - c0}
    after = store.traffic()
    run["setup_traffic"], run["epochs"] = (after - before).as_dict(), []
    try:
        for e in range(args.epochs):
            order = epoch_order(len(shard.ranges), args.seed + repeat, e)
            before = store.traffic()
            t0, c0 = time.perf_counter(), time.process_time()
            got = read(order)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            traffic = store.traffic() - before
            check(name, shard, got, truth)
            if e == 0:
                run["digests"] = {
                    str(g): table_digest(table) for g, table, _ in sorted(got, key=lambda x: x[0])
                }
            nbytes = sum(shard.ranges[g][1] - shard.ranges[g][0] for g in order)
            rows = sum(shard.metadata.row_group(g).num_rows for g in order)
            run["epochs"].append(
                {
                    "epoch": e,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "images": rows,
                    "bytes": nbytes,
                    "images_per_s": rows / wall,
                    "mb_per_s": nbytes / wall / 1e6,
                    "cpu_ms_per_mb": cpu * 1e3 / (nbytes / 1e6),
                    "cpu_us_per_image": cpu * 1e6 / rows,
                    "traffic": traffic.as_dict(),
                }
            )
            del got
    finally:
        close = getattr(read, "close", None)
        if close is not None:
            close()
    return run


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant, medians over repeats for epoch 1 and for the later epochs, and the paired
    ratios to ``lakeshard`` (the median of per-repeat ratios)."""
    keys = ("mb_per_s", "images_per_s", "cpu_ms_per_mb", "cpu_us_per_image")
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        row: dict[str, Any] = {
            "setup_s": statistics.median(r["setup_s"] for r in rs),
            "setup_cpu_s": statistics.median(r["setup_cpu_s"] for r in rs),
        }
        for part, pick in (("epoch1", slice(0, 1)), ("later", slice(1, None))):
            eps = [list(r["epochs"][pick]) for r in rs]
            flat = [e for es in eps for e in es]
            if not flat:
                continue
            row[part] = {k: statistics.median(e[k] for e in flat) for k in keys}
            for k in ("requests", "gets", "heads", "connections", "body_bytes"):
                row[part][k] = statistics.median(e["traffic"][k] for e in flat)
            if name != "lakeshard" and "lakeshard" in runs:
                ref = [list(r["epochs"][pick]) for r in runs["lakeshard"]]
                for k in ("mb_per_s", "cpu_ms_per_mb"):
                    ratios = [
                        a[k] / b[k] for x, y in zip(eps, ref, strict=True) for a, b in zip(x, y, strict=True)
                    ]
                    row[part][f"{k}_vs_lakeshard"] = statistics.median(ratios)
        out[name] = row
    return out


def print_table(summary: dict[str, Any], missing: dict[str, str]) -> None:
    head = (
        f"{'variant':<18} {'epoch':<6} {'MB/s':>7} {'×ours':>6} {'images/s':>9} {'CPU ms/MB':>9} {'×ours':>6} "
        f"{'CPU µs/img':>10} {'GETs':>5} {'HEADs':>5} {'conns':>5} {'MB served':>9}"
    )
    print(head)
    print("-" * len(head))
    for name, row in summary.items():
        for part in ("epoch1", "later"):
            if part not in row:
                continue
            p = row[part]
            print(
                f"{name:<18} {part:<6} {p['mb_per_s']:>7.1f} {p.get('mb_per_s_vs_lakeshard', 1.0):>6.2f} "
                f"{p['images_per_s']:>9.0f} {p['cpu_ms_per_mb']:>9.2f} {p.get('cpu_ms_per_mb_vs_lakeshard', 1.0):>6.2f} "
                f"{p['cpu_us_per_image']:>10.1f} {p['gets']:>5.0f} {p['heads']:>5.0f} {p['connections']:>5.0f} "
                f"{p['body_bytes'] / 1e6:>9.2f}"
            )
    print()
    for name, row in summary.items():
        print(
            f"{name:<18} setup (client, pools; pyarrow: S3 and the file opened): {row['setup_s'] * 1e3:.0f} ms, CPU {row['setup_cpu_s'] * 1e3:.0f} ms"
        )
    for name, why in missing.items():
        print(f"{name:<18} NOT RUN: {why}")


# -- the dataset ---------------------------------------------------------------------------------
def prepare(args: argparse.Namespace, work: Path) -> Path:
    """The synthetic dataset under ``work`` (reused when a run with the same settings built it)."""
    dataset = work / f"rr-{args.images}-{args.size}-q{args.quality}-rg{args.row_group_bytes}"
    if not (dataset / "dataset.json").exists():
        log.info("building %d synthetic %d px JPEGs in %s", args.images, args.size, dataset)
        _data.write_shards(
            dataset,
            _data.synthetic_jpegs(args.images, args.size, args.quality),
            [i % 10 for i in range(args.images)],
            size=args.size,
            quality=args.quality,
            classes=10,
            row_group_bytes=args.row_group_bytes,
        )
    return dataset


def open_shard(store: RemoteStore, dataset: Path) -> Shard:
    """The train shard of ``dataset`` (a folder the store serves) as the variants read it."""
    rel = shard_relpath("train", 0, 1)
    footer = read_shard_footer(store.uri(f"{dataset.name}/{rel}"))
    md = footer.metadata
    ranges = [row_group_range(md, g) for g in range(md.num_row_groups)]
    # The ETag quoted, as If-Match sends it (the libraries send it as given).
    key = f"{dataset.name}/{rel}"
    return Shard(dataset / rel, store.bucket, key, md, footer.size, f'"{footer.etag}"', ranges)


def file_truth(shard: Shard) -> dict[int, tuple[bytes, str]]:
    """Each row group's bytes in the file on disk and the digest of its decoded table."""
    data = shard.path.read_bytes()
    return {
        g: (data[lo:hi], table_digest(shard.decode(g, data[lo:hi])))
        for g, (lo, hi) in enumerate(shard.ranges)
    }


def missing_variants(names: list[str]) -> dict[str, str]:
    """The variants that cannot run here, and why (their package is not installed)."""
    out = {}
    for name in names:
        package = VARIANTS[name][0]
        if package is not None and importlib.util.find_spec(package) is None:
            out[name] = (
                f"package {package!r} is not installed (pip install {package}; see benchmarks/README.md)"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument(
        "--row-group-bytes",
        default=str(_data.ROW_GROUP_BYTES),
        help="the shard's row-group size (default: the shard job's)",
    )
    parser.add_argument("--latency-ms", type=float, default=20.0, help="before each response's first byte")
    parser.add_argument("--bandwidth", default="50MB", help="per connection, per second (decimal MB or MiB)")
    parser.add_argument("--concurrency", type=int, default=8, help="reads in flight, for every variant")
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs per repeat (the first one with a new client)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="a tiny dataset (64 images of 32 px, 16 kB row groups), 1 repeat, 2 epochs, 2 ms",
    )
    parser.add_argument(
        "--workdir", help="where to build (and keep) the dataset (default: a temporary folder)"
    )
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)
    if args.small:
        args.images, args.size, args.row_group_bytes = 64, 32, "16KiB"
        args.repeats, args.epochs, args.latency_ms = 1, 2, 2.0
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "lakeshard" not in names:
        parser.error(
            f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)}); lakeshard, the reference, must be one"
        )
    try:
        args.bandwidth_bytes = parse_rate(args.bandwidth)
        args.row_group_bytes = parse_rate(str(args.row_group_bytes))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    try:
        find_nginx()
    except NginxMissingError as exc:
        parser.error(str(exc))
    log_to_stdout()
    missing = missing_variants(names)
    names = [n for n in names if n not in missing]
    for name, why in missing.items():
        log.warning("%s: NOT RUN: %s", name, why)

    errors: dict[str, str] = {}
    with work_folder(args.workdir) as work:
        dataset = prepare(args, work)
        with RemoteStore(work, latency_ms=args.latency_ms, bandwidth=args.bandwidth_bytes) as store:
            os.environ.update(store.environ())
            os.environ.pop("AWS_ENDPOINT_URL_S3", None)
            shard = open_shard(store, dataset)
            truth = file_truth(shard)
            log.info(
                "%d images in %d row groups of %.2f MB (median), %.1f MB shard; %g ms, %.0f MB/s per connection",
                shard.metadata.num_rows,
                len(shard.ranges),
                statistics.median(hi - lo for lo, hi in shard.ranges) / 1e6,
                shard.size / 1e6,
                args.latency_ms,
                args.bandwidth_bytes / 1e6,
            )
            runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for r in range(args.repeats):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    if name in errors:
                        continue
                    try:
                        runs[name].append(measure(name, shard, store, args, r, truth))
                    except AssertionError:
                        raise
                    except Exception as exc:  # a library that cannot read this store: say exactly why
                        errors[name] = f"{type(exc).__name__}: {exc}"
                        log.warning("%s failed: %s", name, errors[name])
                log.info("repeat %d/%d done", r + 1, args.repeats)
    runs = {n: rs for n, rs in runs.items() if rs and n not in errors}
    summary = summarize(runs)
    print_table(summary, {**missing, **{n: f"failed: {e}" for n, e in errors.items()}})
    result = {
        "args": vars(args),
        "cpu_count": os.cpu_count(),
        "images": shard.metadata.num_rows,
        "row_groups": len(shard.ranges),
        "shard_bytes": shard.size,
        "ran": sorted(runs),
        "missing": missing,
        "failed": errors,
        "same_bytes": True,  # check() raises otherwise
        "row_group_digests": {n: rs[0]["digests"] for n, rs in runs.items()},
        "summary": summary,
        "runs": runs,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    write_out(args.out, result)
    return 1 if "lakeshard" in errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
