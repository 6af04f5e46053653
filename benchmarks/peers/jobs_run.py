"""Our jobs side by side with the tools users would pick instead to turn a raw image lake into
training shards, each doing the same per-image work, each with its own writer in its own
environment.

```
bash scripts/setup_peers.sh                 # the peers' virtual environments (once)
python benchmarks/peers/jobs_run.py --images 4000 --rounds 3 --out benchmarks/results/jobs_peers.json
python benchmarks/peers/jobs_run.py --tools ceiling,lakeshard-local,webdataset --images 500 --rounds 1
```

The raw lake (``benchmarks/_data.py`` ``write_lake``: ``--images`` seeded photo-like JPEGs of
varied sizes, about 498x388 px and 70 kB, every fifth with an EXIF orientation, in ``--classes``
class folders; made once under ``--work``) goes through the per-image work of the shard job
(decode, orient, RGB, center crop resized to ``--size``, JPEG at ``--quality``:
``per_image.prepare``, byte for byte the shard job's) into each tool's format (:data:`TOOLS`):

Our packages' bytecode is compiled first (:func:`compile_ours`), as ``pip install`` compiles the
peers'; each tool then runs as an installed package would. Before ``lakeshard-spark``'s first run
``python -m jobs.spark_cds`` makes its driver JVM's class archive (:func:`make_spark_archive`), as
a user of local Spark does once.

* ``ceiling``: the shard job's own per-image function in a Pool of ``--workers``, writing nothing;
* ``lakeshard-local``, ``-dask``, ``-spark``: ``python -m jobs.build`` (both jobs in one
  command) on that engine (``jobs_lakeshard.py``);
* ``webdataset``, ``streaming`` (Mosaic MDS), ``litdata``, ``ray``, ``petastorm``: the tool's
  ``build`` in ``peer_<tool>.py``, its own parallel writer with ``--workers`` processes or threads.

Each run is a fresh process in a cgroup of its own (``metered.py``): wall time from its start to
its exit (images/s end to end), images/s at steady state (from the first image's work done to the
last's as the tool tells, or the shard job's preprocessing pass by its log), CPU ms per image of
the whole process tree (the cgroup's ``cpuacct.usage``: JVMs, Ray's and Dask's processes
included) end to end and at steady state (the cgroup's usage sampled every 0.1 s, interpolated
at the steady span's ends, over every image), peak PSS of the tree, and the bytes it wrote. Tools run in ``--rounds`` rounds, the
order reversed every other round; the table gives medians, and each tool's end-to-end and steady
rates as paired ratios to the ceiling's steady rate of the same round. After its first run each
tool's stored images are read back (``stored``) and compared with ``prepare``'s bytes for every
lake image: every image once, with the same bytes. A tool whose environment or module is missing,
or whose run fails, is a row saying so.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from _data import write_lake  # noqa: E402
from _timing import alternate, other_load, paired, write_json  # noqa: E402
from build_cli import lake_images  # noqa: E402
from metered import Metered, run_metered  # noqa: E402
from per_image import prepare  # noqa: E402

#: A run longer than this is stopped and reported as failed.
RUN_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class Tool:
    """How a row runs: ``python`` (None: this environment's; else a path below ``--envs``) runs
    ``script`` with ``args`` before the ``build`` and ``stored`` subcommands; ``setup``: the
    command that makes its environment."""

    script: str
    python: str | None = None
    args: tuple[str, ...] = ()
    setup: str = "bash scripts/setup.sh"

    def interpreter(self, envs: Path) -> Path:
        return Path(sys.executable) if self.python is None else envs / self.python

    def missing(self, envs: Path) -> str | None:
        """Why this row cannot run here, or None."""
        if not self.interpreter(envs).exists():
            return f"not installed: {self.setup}"
        if not (HERE / self.script).exists():
            return f"benchmarks/peers/{self.script} is not there yet"
        return None

    def command(self, envs: Path, *args: str) -> list[str]:
        return [str(self.interpreter(envs)), str(HERE / self.script), *self.args, *args]


def _ours(engine: str) -> Tool:
    return Tool("jobs_lakeshard.py", args=("--engine", engine))


def _peer(name: str, venv: str | None = None, setup: str | None = None) -> Tool:
    return Tool(
        f"peer_{name}.py",
        python=f"{venv or f'.venv-peers/{name}'}/bin/python",
        setup=setup or f"bash scripts/setup_peers.sh {name}",
    )


#: Every row: its name and how it runs (a new tool is one line here and its ``peer_<tool>.py``).
TOOLS: dict[str, Tool] = {
    "ceiling": _ours("ceiling"),
    "lakeshard-local": _ours("local"),
    "lakeshard-dask": _ours("dask"),
    "lakeshard-spark": _ours("spark"),
    "webdataset": _peer("webdataset"),
    "streaming": _peer("streaming"),
    "litdata": _peer("litdata"),
    "ray": _peer("ray"),
    "petastorm": _peer("petastorm", ".venv-petastorm", "bash scripts/setup_petastorm.sh"),
}
#: Rows that write nothing: no stored images to compare.
WRITES_NOTHING = frozenset({"ceiling"})


# -- the same work ------------------------------------------------------------------------------------
def _expected_one(job: tuple[str, int, int, int]) -> tuple[int, str]:
    path, label, size, quality = job
    return label, hashlib.sha256(prepare(Path(path).read_bytes(), size, quality)).hexdigest()


def expected(lake: Path, *, size: int, quality: int, workers: int) -> collections.Counter[tuple[int, str]]:
    """``(label, sha256 of prepare's bytes)`` of every lake image, counted (kept beside the lake
    until the lake is made again)."""
    cache = lake.parent / f"{lake.name}.expected-{size}-{quality}.json"
    stamp = (lake / ".complete").stat().st_mtime_ns
    if cache.exists() and (kept := json.loads(cache.read_text()))["stamp"] == stamp:
        return collections.Counter({(int(k[0]), k[1]): n for k, n in kept["counts"]})
    jobs = [(str(p), label, size, quality) for p, label in lake_images(lake)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        found = collections.Counter(pool.imap_unordered(_expected_one, jobs, chunksize=16))
    cache.write_text(json.dumps({"stamp": stamp, "counts": [[list(k), n] for k, n in found.items()]}))
    return found


def compare(
    tool: Tool, out: Path, want: collections.Counter[tuple[int, str]], *, envs: Path, log: Any
) -> dict[str, Any]:
    """The tool's stored images against ``want``: how many are missing, extra (or repeated)."""
    cmd = tool.command(envs, "stored", "--out", str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    log.write(proc.stderr)
    if proc.returncode != 0:
        return {"error": f"stored failed (exit {proc.returncode})"}
    got = collections.Counter(
        (int(label), digest) for label, digest in map(str.split, proc.stdout.splitlines())
    )
    missing, extra = want - got, got - want
    return {
        "stored": sum(got.values()),
        "missing": sum(missing.values()),
        "extra": sum(extra.values()),
        "same": not missing and not extra,
    }


# -- one run ----------------------------------------------------------------------------------------
def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_one(name: str, *, lake: Path, out: Path, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """One fresh run of ``name``'s build in its own cgroup: what it did and cost, or an error."""
    tool = TOOLS[name]
    shutil.rmtree(out, ignore_errors=True)
    cmd = tool.command(args.envs, "build", "--lake", str(lake), "--out", str(out))
    cmd += ["--size", str(args.size), "--quality", str(args.quality), "--workers", str(args.workers)]
    log.write(f"\n=== {name}: {' '.join(cmd)}\n")
    log.flush()
    with other_load() as others:
        m: Metered = run_metered(cmd, env=dict(os.environ), cwd=ROOT, stderr=log, timeout=RUN_TIMEOUT_S)
    if m.returncode != 0:
        why = "timed out" if m.returncode is None else f"exit {m.returncode}"
        return {"error": f"build failed ({why}; see {log.name})"}
    built = json.loads(m.stdout.strip().splitlines()[-1])
    images = built["images"]
    first, last = built.get("first_done"), built.get("last_done")
    steady = images / (last - first) if first is not None and last is not None and last > first else None
    steady_cpu = m.cpu_s_between(first, last) if steady is not None else None
    return {
        "images": images,
        "wall_s": m.wall_s,
        "images_per_s": images / m.wall_s,
        "steady_images_per_s": steady,
        "cpu_s": m.cpu_s,
        "cpu_from": m.cpu_from,
        "cpu_ms_per_image": m.cpu_s * 1e3 / max(images, 1),
        "steady_cpu_ms_per_image": None if steady_cpu is None else steady_cpu * 1e3 / max(images, 1),
        "peak_pss": m.peak_pss,
        "bytes_written": _bytes(out) if out.exists() else 0,
        "leftover_processes": m.leftover,
        "other_load": others(),
    }


# -- the table ----------------------------------------------------------------------------------------
def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: dict[str, list[dict[str, Any]]], checks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per tool: medians over its good runs, and ratios to the ceiling's steady rate, paired by round."""
    ceiling = runs.get("ceiling", [])
    rows: dict[str, Any] = {}
    for name, rs in runs.items():
        good = [r for r in rs if "error" not in r]
        if not good:
            rows[name] = {"error": rs[0]["error"] if rs else "no runs"}
            continue
        row: dict[str, Any] = {"runs": len(good), "failed_runs": [r["error"] for r in rs if "error" in r]}
        for key in (
            "images_per_s",
            "steady_images_per_s",
            "cpu_ms_per_image",
            "steady_cpu_ms_per_image",
            "wall_s",
            "other_load",
        ):
            row[key] = _median([r[key] for r in good])
        row["peak_pss_mib"] = _median([r["peak_pss"] / 2**20 for r in good])
        row["bytes_written"] = _median([r["bytes_written"] for r in good])
        row["cpu_from"] = sorted({r["cpu_from"] for r in good})
        for key in ("images_per_s", "steady_images_per_s"):
            pairs = [
                (r[key], c["steady_images_per_s"])
                for r, c in zip(rs, ceiling, strict=False)
                if "error" not in r and "error" not in c and r[key] and c["steady_images_per_s"]
            ]
            row[f"{key}_of_ceiling"] = paired(*zip(*pairs, strict=True)) if pairs else None
        row["check"] = checks.get(name, {"skipped": "writes nothing" if name in WRITES_NOTHING else "no run"})
        rows[name] = row
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: dict[str, Any], out: Any = sys.stdout) -> None:
    print(
        f"\n{'tool':16} {'img/s e2e':>9} {'of ceil':>7} {'img/s steady':>12} {'of ceil':>7} "
        f"{'CPU ms/img':>10} {'steady':>6} {'PSS MiB':>7} {'MB written':>10} {'wall s':>7}  same bytes",
        file=out,
    )
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:16} {r['error']}", file=out)
            continue
        check = r["check"]
        same = (
            check.get("skipped")
            or check.get("error")
            or ("yes" if check["same"] else f"NO: {check['missing']} missing, {check['extra']} extra")
        )
        print(
            f"{name:16} {_fmt(r['images_per_s'], '9.0f')} {_fmt(r['images_per_s_of_ceiling'], '7.2f')} "
            f"{_fmt(r['steady_images_per_s'], '12.0f')} {_fmt(r['steady_images_per_s_of_ceiling'], '7.2f')} "
            f"{_fmt(r['cpu_ms_per_image'], '10.2f')} {_fmt(r['steady_cpu_ms_per_image'], '6.2f')} "
            f"{_fmt(r['peak_pss_mib'], '7.0f')} "
            f"{_fmt(r['bytes_written'] and r['bytes_written'] / 1e6, '10.1f')} {_fmt(r['wall_s'], '7.1f')}  {same}"
            + (f"  ({len(r['failed_runs'])} failed: {r['failed_runs'][0]})" if r["failed_runs"] else ""),
            file=out,
        )


# -- main ---------------------------------------------------------------------------------------------
#: Our packages, which the ``lakeshard-*`` tools and the ceiling import from this checkout.
OUR_PACKAGES = ("jobs", "lakeshard")


def compile_ours(root: Path = ROOT) -> None:
    """Compile our packages' bytecode, as ``pip install`` compiles every peer's at install time.

    Run from a checkout, each process of ours (the driver, the forkserver, each Dask worker,
    each of Spark's Python workers) would otherwise compile our modules from source wherever
    ``PYTHONDONTWRITEBYTECODE`` is set (as in some CI images), or on a checkout's first run:
    ~0.2 s of CPU a process that no installed package pays."""
    import compileall

    for name in OUR_PACKAGES:
        if not compileall.compile_dir(root / name, quiet=1):
            raise SystemExit(f"jobs_run.py: could not compile {root / name}")


def make_spark_archive(work: Path, log: Any) -> None:
    """Make the class archive of the Spark engine's driver JVM (``python -m jobs.spark_cds``,
    as docs/clusters.md tells a user of local Spark to do once), kept under ``work`` with the
    lake: every ``lakeshard-spark`` run maps it."""
    os.environ["LAKESHARD_SPARK_CDS_DIR"] = str(work / "spark-cds")
    cmd = [sys.executable, "-m", "jobs.spark_cds"]
    log.write(f"\n=== {' '.join(cmd)}\n")
    log.flush()
    env = {**os.environ, "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=log, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(
            f"jobs_run.py: python -m jobs.spark_cds failed (exit {proc.returncode}; see {log.name})"
        )


def _tools(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in TOOLS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(TOOLS)}")
    return items


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tools", type=_tools, default=list(TOOLS), help=f"comma-separated: {','.join(TOOLS)}")
    p.add_argument("--images", type=_count, default=4000, help="images in the raw lake (default 4000)")
    p.add_argument("--classes", type=_count, default=10, help="class folders of the lake (default 10)")
    p.add_argument("--size", type=_count, default=224, help="side of the stored images (default 224)")
    p.add_argument(
        "--quality", type=_count, default=90, help="JPEG quality of the stored images (default 90)"
    )
    p.add_argument("--rounds", type=_count, default=3, help="rounds of every tool (default 3)")
    p.add_argument(
        "--workers", type=_count, default=os.cpu_count() or 1, help="processes per tool (default: cores)"
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "lakeshard-jobs-peers",
        help="where the lake (kept between runs) and each tool's output go",
    )
    p.add_argument(
        "--envs",
        type=Path,
        default=ROOT,
        help="the folder holding the peers' environments (.venv-peers/, .venv-petastorm; default: this checkout)",
    )
    p.add_argument("--out", type=Path, help="write every run and the table as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    log_path = args.work / "jobs_run.log"
    lake = write_lake(
        args.work / f"lake-{args.images}-c{args.classes}",
        images=args.images,
        classes=args.classes,
        workers=args.workers,
    )
    want = expected(lake, size=args.size, quality=args.quality, workers=args.workers)
    compile_ours()
    print(f"{args.images} JPEGs in {lake}; log: {log_path}", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.tools}
    checks: dict[str, dict[str, Any]] = {}
    with open(log_path, "a") as log:
        if "lakeshard-spark" in args.tools and not TOOLS["lakeshard-spark"].missing(args.envs):
            make_spark_archive(args.work, log)
        for r in range(args.rounds):
            for name in alternate(args.tools, r):
                if why := TOOLS[name].missing(args.envs):
                    runs[name].append({"error": why})
                    continue
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                out = args.work / "out" / name
                runs[name].append(run_one(name, lake=lake, out=out, args=args, log=log))
                if name not in checks and name not in WRITES_NOTHING and "error" not in runs[name][-1]:
                    checks[name] = compare(TOOLS[name], out, want, envs=args.envs, log=log)
                shutil.rmtree(out, ignore_errors=True)
    rows = summarize(runs, checks)
    print_table(rows)
    write_json(
        args.out,
        {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "args": {k: str(v) for k, v in vars(args).items()},
            "table": rows,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
