"""Our loader side by side with the loaders users would pick instead, on the same JPEG bytes,
from local disk and from a remote-like S3 store.

```
bash scripts/setup_peers.sh                 # the peers' virtual environments (once)
bash scripts/setup_petastorm.sh             # petastorm's (once)
python benchmarks/peers/run.py --images 2048 --repeats 3 --out benchmarks/results/peers.json
python benchmarks/peers/run.py --set photo --images 1024 --settings remote
python benchmarks/peers/run.py --tools lakeshard,webdataset --images 256 --repeats 1 --epochs 2
```

From one set of JPEGs made here (``--set small``: 224 px photo-like images of ~15-25 kB;
``--set photo``: the same size with photo-like fine detail, ~100 kB each), every tool writes its
own format with its own writer, in its own virtual environment (``.venv`` for ours,
``.venv-petastorm`` for petastorm, made by ``scripts/setup_petastorm.sh``, and
``.venv-peers/<tool>`` for the others, made by ``scripts/setup_peers.sh``):

* ``lakeshard``: one Parquet shard (``lakeshard.format.ShardWriter``), :class:`loaders.ShardLoader`;
* ``streaming``: Mosaic Streaming's ``MDSWriter``, ``StreamingDataset`` + a DataLoader;
* ``litdata``: LitData's ``optimize``, its ``StreamingDataset`` + ``StreamingDataLoader``;
* ``webdataset``: tar shards (``ShardWriter``), ``WebDataset`` + ``WebLoader``;
* ``dataloader``: the JPEGs as files, a map-style Dataset + torch ``DataLoader``;
* ``ray``: Parquet files written by Ray Data, ``read_parquet`` + ``map_batches`` +
  ``iter_torch_batches``;
* ``petastorm``: a petastorm dataset (``materialize_dataset`` on Spark), ``make_reader`` +
  ``petastorm.pytorch.DataLoader``; local only (``LOCAL_ONLY``).

Each tool then streams its files for ``--epochs`` epochs (batch 64, shuffled, decoding with the
same decoder, simplejpeg; ``--workers`` worker processes or threads, one per core by default)
in a fresh process per run, tools alternating round-robin over ``--repeats`` rounds. Settings:
``local`` (the written folder) and ``remote`` (the same folders served by
``benchmarks/remote_store.py``: nginx behind a latency and bandwidth shim, ``--latency-ms``
before each response's first byte and ``--bandwidth`` per connection, read through each tool's
own S3 or HTTP path). Remote, ours runs twice: without a cache and with ``cache_dir``; Streaming
and LitData always copy whole shards into a fresh local cache, so epoch 1 is their cold epoch.

Per run and epoch: images/s; time to the first batch (of the loader, from before it is made,
and of the process, from before it is started); CPU seconds per image of the whole process tree
(worker processes included); peak RSS and PSS of the tree; requests and bytes the store served;
and whether every image came exactly once. The table gives medians over the rounds of epoch 1
and of the later epochs (each run's median of epochs 2..N). A tool whose environment is missing
or whose run fails is a row saying so, never left out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from remote_store import NginxMissingError, RemoteStore, parse_rate  # noqa: E402

TOOLS = ("lakeshard", "streaming", "litdata", "webdataset", "dataloader", "ray", "petastorm")
SETTINGS = ("local", "remote")
#: ``--set``: how each image is drawn and its JPEG quality: small, ~21 kB at 224 px
#: (``_data.synthetic_image``); photo, ~97 kB (``_data.photo_image``).
SETS = ("small", "photo")
#: A run (all its epochs) that takes longer than this is stopped and reported as failed.
RUN_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of a table: a tool, a setting, and (ours, remote) whether it has a cache."""

    tool: str
    setting: str
    cache: bool = False

    @property
    def name(self) -> str:
        return f"{self.tool} + cache_dir" if self.cache and self.tool == "lakeshard" else self.tool


#: Where ``scripts/setup_peers.sh`` makes each peer's environment (``--venvs``).
VENVS = ROOT / ".venv-peers"
#: The tools whose environment is elsewhere (not ``<venvs>/<tool>``), and the script that makes it.
OWN_VENVS = {"petastorm": (ROOT / ".venv-petastorm", "scripts/setup_petastorm.sh")}
#: The tools that have no remote row, and why (their row in the remote table says so).
LOCAL_ONLY = {"petastorm": "local only: petastorm reads s3:// through s3fs, which .venv-petastorm leaves out"}


def python_for(tool: str, venvs: Path = VENVS) -> Path:
    """The interpreter of the tool's own environment (ours: this one)."""
    if tool == "lakeshard":
        return Path(sys.executable)
    venv = OWN_VENVS[tool][0] if tool in OWN_VENVS else venvs / tool
    return venv / "bin" / "python"


def not_installed(tool: str) -> str:
    """The row of a tool whose environment is missing: the command that makes it."""
    if tool in OWN_VENVS:
        return f"not installed: bash {OWN_VENVS[tool][1]}"
    return f"not installed: bash scripts/setup_peers.sh {tool}"


def variants(tools: list[str], settings: list[str]) -> list[Variant]:
    out = []
    for setting in settings:
        for tool in tools:
            remote = setting == "remote"
            # Streaming and LitData only read remote data through their cache; ours both ways.
            out.append(Variant(tool, setting, cache=remote and tool in ("streaming", "litdata")))
            if remote and tool == "lakeshard":
                out.append(Variant(tool, setting, cache=True))
    return out


# -- the data ---------------------------------------------------------------------------------------
def make_jpegs(folder: Path, *, kind: str, images: int, size: int) -> dict[str, float]:
    """``images`` JPEGs of ``kind`` in ``folder`` with ``index.json`` (``peer_common.JpegSet``),
    made once (kept when the index says the same): their mean size in kB."""
    from _data import jpeg

    if kind == "small":
        from _data import synthetic_image as draw

        quality = 95
    else:
        from _data import PHOTO_QUALITY as quality
        from _data import photo_image as draw
    index = folder / "index.json"
    want = {"kind": kind, "size": size, "quality": quality, "count": images}
    if index.exists():
        meta = json.loads(index.read_text())
        if {k: meta.get(k) for k in want} == want:
            return {"mean_kb": meta["mean_kb"]}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    entries, total = [], 0
    for i in range(images):
        data = jpeg(draw(rng, size), quality)
        (folder / f"{i:06d}.jpg").write_bytes(data)
        entries.append([f"{i:06d}.jpg", i])
        total += len(data)
    mean_kb = total / images / 1000
    index.write_text(json.dumps({**want, "mean_kb": mean_kb, "images": entries}))
    return {"mean_kb": mean_kb}


def write_formats(jpegs: Path, out: Path, tools: list[str], venvs: Path, log: Path) -> dict[str, Any]:
    """Each tool's format of ``jpegs`` in ``out/<tool>``, written by the tool's own writer in its
    own environment, unless already written from the same set: seconds it took, or the error."""
    stamp_of = (jpegs / "index.json").stat().st_mtime_ns
    written: dict[str, Any] = {}
    for tool in tools:
        folder, stamp = out / tool, out / f"{tool}.written"
        if stamp.exists() and stamp.read_text() == str(stamp_of):
            written[tool] = json.loads((out / f"{tool}.json").read_text())
            continue
        if not python_for(tool, venvs).exists():
            written[tool] = {"error": not_installed(tool)}
            continue
        shutil.rmtree(folder, ignore_errors=True)
        print(f"writing {tool}'s format ...", file=sys.stderr, flush=True)
        with open(log, "a") as err:
            proc = subprocess.run(
                [
                    str(python_for(tool, venvs)),
                    str(HERE / f"peer_{tool}.py"),
                    "write",
                    "--jpegs",
                    str(jpegs),
                    *("--out", str(folder)),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=ROOT,
            )
        if proc.returncode != 0:
            written[tool] = {"error": f"write failed (exit {proc.returncode}; see {log})"}
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["bytes"] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        (out / f"{tool}.json").write_text(json.dumps(result))
        stamp.write_text(str(stamp_of))
        written[tool] = result
    return written


# -- one run ----------------------------------------------------------------------------------------
def epoch_record(line: str) -> dict[str, Any] | None:
    """The epoch record a tool printed as one JSON object on ``line``; None for any other line."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def run_one(
    variant: Variant, *, data: Path, store: RemoteStore | None, args: argparse.Namespace, log: Path
) -> dict[str, Any]:
    """One fresh process of ``variant`` for ``args.epochs`` epochs: its epoch records, each with
    the store's traffic during that epoch, or ``{"error": ...}``."""
    python = python_for(variant.tool, args.venvs)
    if not python.exists():
        return {"error": not_installed(variant.tool)}
    if variant.setting == "remote" and variant.tool in LOCAL_ONLY:
        return {"error": LOCAL_ONLY[variant.tool]}
    if variant.setting == "remote":
        assert store is not None
        source = store.uri(variant.tool)
        env = {**os.environ, **store.environ(), "S3_ENDPOINT_URL": store.endpoint}
    else:
        source, env = str(data / variant.tool), dict(os.environ)
    env.pop("LAKESHARD_CACHE_DIR", None)
    with contextlib.ExitStack() as stack:
        command = [str(python), str(HERE / f"peer_{variant.tool}.py"), "read", "--source", source]
        command += [
            "--images",
            str(args.images),
            "--epochs",
            str(args.epochs),
            "--workers",
            str(args.workers),
        ]
        if variant.cache:
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"peers-{variant.tool}-cache-"))
            command += ["--cache", cache]
        before = store.traffic() if store is not None and variant.setting == "remote" else None
        err = stack.enter_context(open(log, "a"))
        err.write(f"\n=== {variant} ===\n")
        err.flush()
        command += ["--started-at", repr(time.time())]
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env
        )
        records: list[dict[str, Any]] = []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            assert proc.stdout is not None and proc.stdin is not None
            while len(records) < args.epochs:
                ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
                line = proc.stdout.readline() if ready else ""
                if not line:
                    proc.kill()
                    why = "timed out" if not ready else f"exit {proc.wait()}"
                    return {"error": f"run failed after {len(records)} epochs ({why}; see {log})"}
                record = epoch_record(line)
                if record is None:  # a tool's library printing on stdout (Ray, once, under load)
                    err.write(f"(on the tool's stdout, not a record) {line.rstrip()}\n")
                    err.flush()
                    continue
                if before is not None:
                    assert store is not None
                    now = store.traffic()
                    record["traffic"] = (now - before).as_dict()
                    before = now
                records.append(record)
                if len(records) < args.epochs:
                    proc.stdin.write("\n")
                    proc.stdin.flush()
            proc.stdin.close()
            if proc.wait(timeout=60) != 0:
                return {"error": f"exit {proc.returncode} after its epochs (see {log})"}
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"epochs": records}


# -- the tables --------------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs of one variant: epoch 1, and each run's median of the later epochs."""
    good = [r["epochs"] for r in runs if "epochs" in r]
    errors = [r["error"] for r in runs if "error" in r]
    if not good:
        return {"error": errors[0] if errors else "no runs"}

    def first(key: str) -> float | None:
        return _median([e[0].get(key) for e in good])

    def later(key: str) -> float | None:
        return _median([_median([x.get(key) for x in e[1:]]) for e in good if len(e) > 1])

    def traffic(epochs: list[dict[str, Any]], key: str) -> list[float]:
        return [x["traffic"][key] for x in epochs if "traffic" in x]

    out: dict[str, Any] = {
        "runs": len(good),
        "failed_runs": errors,
        "exactly_once": all(x["exactly_once"] for e in good for x in e),
    }
    for key in ("images_per_s", "cpu_s_per_image", "first_batch_s"):
        out[key] = {"epoch1": first(key), "later": later(key)}
    out["process_first_batch_s"] = first("process_first_batch_s")
    out["peak_rss_mb"] = _median([max(x["peak_rss"] for x in e) / 2**20 for e in good])
    out["peak_pss_mb"] = _median([max(x["peak_pss"] for x in e) / 2**20 for e in good])
    if any("traffic" in x for e in good for x in e):
        for key in ("requests", "body_bytes"):
            out[key] = {
                "epoch1": _median([traffic(e[:1], key)[0] for e in good]),
                "later": _median([_median(traffic(e[1:], key)) for e in good if len(e) > 1]),
            }
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(setting: str, rows: dict[str, dict[str, Any]], out: Any = sys.stdout) -> None:
    head = (
        f"{'tool':22} {'img/s e1':>9} {'img/s 2+':>9} {'1st batch':>9} {'1st (proc)':>10} "
        f"{'CPU ms/img e1':>13} {'2+':>6} {'PSS MB':>7} {'RSS MB':>7}"
    )
    if setting == "remote":
        head += f" {'req e1':>7} {'req 2+':>7} {'MB e1':>7} {'MB 2+':>7}"
    print(f"\n{setting}:", file=out)
    print(head + "  once", file=out)
    for name, s in rows.items():
        if "error" in s:
            print(f"{name:22} {s['error']}", file=out)
            continue
        line = (
            f"{name:22} {_fmt(s['images_per_s']['epoch1'], '9.0f')} {_fmt(s['images_per_s']['later'], '9.0f')} "
            f"{_fmt(s['first_batch_s']['epoch1'], '9.2f')} {_fmt(s['process_first_batch_s'], '10.2f')} "
            f"{_fmt(s['cpu_s_per_image']['epoch1'] and s['cpu_s_per_image']['epoch1'] * 1e3, '13.2f')} "
            f"{_fmt(s['cpu_s_per_image']['later'] and s['cpu_s_per_image']['later'] * 1e3, '6.2f')} "
            f"{s['peak_pss_mb']:7.0f} {s['peak_rss_mb']:7.0f}"
        )
        if setting == "remote":
            mb = {k: v and v / 1e6 for k, v in s.get("body_bytes", {}).items()}
            req = s.get("requests", {})
            line += (
                f" {_fmt(req.get('epoch1'), '7.0f')} {_fmt(req.get('later'), '7.0f')}"
                f" {_fmt(mb.get('epoch1'), '7.1f')} {_fmt(mb.get('later'), '7.1f')}"
            )
        line += "  yes" if s["exactly_once"] else "  NO"
        if s["failed_runs"]:
            line += f"  ({len(s['failed_runs'])} failed: {s['failed_runs'][0]})"
        print(line, file=out)


# -- main ---------------------------------------------------------------------------------------------
def _csv(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(choices)}")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tools", type=_csv(TOOLS), default=list(TOOLS), help=f"comma-separated: {','.join(TOOLS)}"
    )
    p.add_argument("--settings", type=_csv(SETTINGS), default=list(SETTINGS), help="local,remote")
    p.add_argument("--set", choices=sorted(SETS), default="small", help="small (~20 kB) or photo (~100 kB)")
    p.add_argument("--images", type=int, default=2048, help="images in the set (default 2048)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels (default 224)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every variant (default 3)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decode workers (default: cores)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="the store's first-byte latency")
    p.add_argument("--bandwidth", default="80MB", help="the store's bandwidth per connection")
    p.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "lakeshard-peers",
        help="where the JPEGs and each tool's files are kept between runs",
    )
    p.add_argument(
        "--venvs",
        type=Path,
        default=VENVS,
        help="the peers' environments (scripts/setup_peers.sh makes them)",
    )
    p.add_argument("--out", type=Path, help="write every record and the summary as JSON here")
    args = p.parse_args(argv)
    for name in ("images", "epochs", "repeats", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    try:
        args.bandwidth_bytes = parse_rate(args.bandwidth)
    except ValueError as exc:
        p.error(f"--bandwidth: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work / f"{args.set}-{args.size}px-{args.images}"
    log = work / "peers.log"
    work.mkdir(parents=True, exist_ok=True)
    jpegs = make_jpegs(work / "jpegs", kind=args.set, images=args.images, size=args.size)
    print(f"{args.images} JPEGs, {args.size} px, {jpegs['mean_kb']:.1f} kB mean; log: {log}", file=sys.stderr)
    data = work / "formats"
    data.mkdir(exist_ok=True)
    written = write_formats(work / "jpegs", data, args.tools, args.venvs, log)
    plan = variants(args.tools, args.settings)
    runs: dict[Variant, list[dict[str, Any]]] = {v: [] for v in plan}
    with contextlib.ExitStack() as stack:
        store = None
        if "remote" in args.settings:
            try:
                store = stack.enter_context(
                    RemoteStore(data, latency_ms=args.latency_ms, bandwidth=args.bandwidth_bytes)
                )
            except NginxMissingError as exc:
                raise SystemExit(f"remote setting: {exc} (or run with --settings local)") from None
        for r in range(args.repeats):
            shift = r % len(plan)
            for variant in plan[shift:] + plan[:shift]:  # round-robin, a different tool first each round
                if "error" in written.get(variant.tool, {}):
                    runs[variant].append({"error": written[variant.tool]["error"]})
                    continue
                print(
                    f"round {r + 1}/{args.repeats}: {variant.setting} {variant.name}",
                    file=sys.stderr,
                    flush=True,
                )
                runs[variant].append(run_one(variant, data=data, store=store, args=args, log=log))
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for setting in args.settings:
        tables[setting] = {v.name: summarize(runs[v]) for v in plan if v.setting == setting}
        print_table(setting, tables[setting])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "date": datetime.date.today().isoformat(),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "jpegs": jpegs,
                    "written": written,
                    "tables": tables,
                    "runs": [
                        {"variant": dataclasses.asdict(v), "name": v.name, "runs": rs}
                        for v, rs in runs.items()
                    ],
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
