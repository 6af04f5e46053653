"""The store clients' own CPU per ranged read: S3 (boto3 against nginx), GCS
(google-cloud-storage against the tests' emulator) and Azure (azure-storage-blob against
Azurite), each read through ``lakeshard.storage`` as the loader reads a row group, with no
latency in the way.

    python benchmarks/client_cpu.py --object-mib 64 --read-mib 4 --rounds 5

Each round reads the whole object in ``--read-mib`` ranges from every store in turn; a read's
CPU is the reading thread's (``time.thread_time``), so the store's server, on the same machine,
is not in it. Every read's bytes are checked against the object's. Prints, per store, the
median CPU milliseconds a read and a MiB, and each store's ratio to S3's; ``--out`` writes every
round as JSON. Why it exists: ``docs/performance.md``, "Stores".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import names, positive, write_out
from emulated_store import Azurite, connection_string
from remote_store import RemoteStore

from lakeshard import storage

STORES = ("s3", "gcs", "azure")


@contextlib.contextmanager
def _s3(folder: Path, data: bytes) -> Iterator[str]:
    (folder / "bench").mkdir(exist_ok=True)
    (folder / "bench" / "object.bin").write_bytes(data)
    with RemoteStore(folder, latency_ms=0, bandwidth=10**12) as store:
        os.environ.update(store.environ())
        yield store.uri("bench/object.bin")


@contextlib.contextmanager
def _gcs(folder: Path, data: bytes) -> Iterator[str]:
    from tests.helpers.gcs_emulator import start_emulator

    emulator = start_emulator()
    try:
        os.environ.update(STORAGE_EMULATOR_HOST=emulator.endpoint, GOOGLE_CLOUD_PROJECT="bench")
        storage.gcs_client().create_bucket("bench")
        storage.write_bytes_atomic("gs://bench/object.bin", data)
        yield "gs://bench/object.bin"
    finally:
        emulator.stop()


@contextlib.contextmanager
def _azure(folder: Path, data: bytes) -> Iterator[str]:
    azurite = Azurite().start()
    try:
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(azurite.endpoint)
        storage.azure_client().create_container("bench")
        storage.write_bytes_atomic("az://bench/object.bin", data)
        yield "az://bench/object.bin"
    finally:
        azurite.stop()


_SERVE: dict[str, Callable[[Path, bytes], contextlib.AbstractContextManager[str]]] = {
    "s3": _s3,
    "gcs": _gcs,
    "azure": _azure,
}


def read_all(uri: str, data: bytes, read_bytes: int) -> float:
    """Thread CPU seconds to read ``uri`` whole in ranges of ``read_bytes``; each range checked."""
    store = storage.store_for(uri)
    began = time.thread_time()
    for start in range(0, len(data), read_bytes):
        got = store.read(uri, start, start + read_bytes)
        if got != data[start : start + read_bytes]:
            raise SystemExit(f"{uri}: the range at {start} came back wrong ({len(got)} bytes)")
    return time.thread_time() - began


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = os.urandom(args.object_mib << 20)
    read_bytes = args.read_mib << 20
    reads = -(-len(data) // read_bytes)
    rounds: dict[str, list[float]] = {s: [] for s in args.stores}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        uris = {s: stack.enter_context(_SERVE[s](Path(tmp), data)) for s in args.stores}
        for s in args.stores:  # a first read of each opens the client's connections
            storage.store_for(uris[s]).read(uris[s], 0, 1024)
        for n in range(args.rounds):
            for s in args.stores:
                rounds[s].append(read_all(uris[s], data, read_bytes) / reads)
            print(f"round {n + 1}/{args.rounds}", file=sys.stderr)
    per_read = {s: statistics.median(v) for s, v in rounds.items()}
    return {
        "object_mib": args.object_mib,
        "read_mib": args.read_mib,
        "rounds": rounds,
        "cpu_ms_per_read": {s: v * 1e3 for s, v in per_read.items()},
        "cpu_ms_per_mib": {s: v * 1e3 / args.read_mib for s, v in per_read.items()},
        "vs_s3": {s: v / per_read["s3"] for s, v in per_read.items()} if "s3" in per_read else {},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--object-mib", type=positive, default=64, help="the object's size (default 64)")
    parser.add_argument("--read-mib", type=positive, default=4, help="one read's size (default 4)")
    parser.add_argument("--rounds", type=positive, default=5, help="rounds of every store (default 5)")
    parser.add_argument(
        "--stores",
        type=names(STORES, "--stores"),
        default=list(STORES),
        help=f"comma-separated, of {','.join(STORES)} (default: all)",
    )
    parser.add_argument("--out", help="write every round and the medians as JSON here")
    args = parser.parse_args(argv)
    if args.read_mib > args.object_mib:
        parser.error(f"--read-mib {args.read_mib} is larger than --object-mib {args.object_mib}")
    result = run(args)
    reads = -(-args.object_mib // args.read_mib)
    print(f"{reads} reads of {args.read_mib} MiB a round; medians of {args.rounds} rounds (thread CPU)")
    print(f"{'store':6s} {'ms/read':>8s} {'ms/MiB':>7s} {'÷ S3':>6s}")
    for s in args.stores:
        ratio = result["vs_s3"].get(s)
        print(
            f"{s:6s} {result['cpu_ms_per_read'][s]:8.2f} {result['cpu_ms_per_mib'][s]:7.2f} "
            f"{'' if ratio is None else format(ratio, '6.2f')}"
        )
    if args.out:
        write_out(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
