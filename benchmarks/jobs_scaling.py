"""How the manifest and shard jobs scale with the number of objects: wall time, time per object
and the driver's peak memory, per engine, each job run exactly as the README runs it.

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "Jobs at growing
sizes".
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import at_least, int_list, names, positive, write_out
from process_peaks import Peaks, PeakWatch

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("manifest", "shard")
ENGINES = ("spark", "dask")


def _write_range(root: str, classes: int, start: int, stop: int, side: int) -> int:
    rng = np.random.default_rng(start)
    for i in range(start, stop):
        label = f"class_{i % classes:03d}"
        folder = Path(root) / label / f"batch{(i // classes) % 16:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
        (folder / f"img_{i:08d}.png").write_bytes(buf.getvalue())
    return stop - start


def build_lake(cache: Path, n: int, *, classes: int, side: int, progress: bool = True) -> Path:
    """The lake of ``n`` objects in ``cache`` (built once; a ``.complete`` marker says it is whole)."""
    root = cache / f"lake-{n}-c{classes}-{side}px"
    if (root / ".complete").exists():
        return root / "raw"
    shutil.rmtree(root, ignore_errors=True)
    step = max(1, min(10_000, n // (4 * (os.cpu_count() or 1))))
    t0, done, shown = time.perf_counter(), 0, 0
    with ProcessPoolExecutor() as pool:
        futures = [
            pool.submit(_write_range, str(root / "raw"), classes, a, min(n, a + step), side)
            for a in range(0, n, step)
        ]
        for f in as_completed(futures):
            done += f.result()
            if progress and (done - shown >= max(1, n // 10) or done == n):
                shown = done
                print(
                    f"  lake {n}: {done:,}/{n:,} objects written, {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
    (root / ".complete").touch()
    return root / "raw"


def job_command(engine: str, job: str, args: list[str], *, spark_master: str, python: str) -> list[str]:
    """The command line the README gives for ``job`` on ``engine``."""
    if engine == "spark":
        spark_submit = shutil.which("spark-submit") or str(Path(python).parent / "spark-submit")
        return [spark_submit, "--master", spark_master, f"jobs/{job}.py", *args]
    return [python, "-m", f"jobs.{job}", "--engine", "dask", *args]


def job_args(job: str, lake: Path, out: Path, a: argparse.Namespace) -> list[str]:
    if job == "manifest":
        return ["--input", str(lake), "--output", str(out), "--split-method", "stratified", "--seed", "0"]
    args = ["--dataset", str(out), "--num-shards", str(a.num_shards), "--image-size", str(a.image_size)]
    if a.threads:
        args += ["--threads", str(a.threads)]
    if a.partitions:
        args += ["--partitions", str(a.partitions)]
    return args


def job_env(python: str, code_root: Path = ROOT) -> dict[str, str]:
    """The jobs' environment: ``code_root`` (the tree whose jobs run) first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code_root), env.get("PYTHONPATH")]))
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("PYSPARK_PYTHON", python)
    env.setdefault("PYSPARK_DRIVER_PYTHON", python)
    return env


def run_job(
    engine: str,
    job: str,
    n: int,
    lake: Path | None,
    out: Path,
    a: argparse.Namespace,
    *,
    args: list[str] | None = None,
    tag: str = "",
) -> dict[str, Any]:
    """Run one job on one lake (its arguments: ``args``, else those of :func:`job_args`); its
    wall time, its CPU time and its driver's peaks. ``tag`` marks its log's name."""
    if args is None:
        if lake is None:
            raise BenchError(f"{engine} {job} {n}: neither a lake nor the job's arguments")
        args = job_args(job, lake, out, a)
    if engine == "dask" and a.scheduler:
        args += ["--scheduler", a.scheduler]
    cmd = job_command(engine, job, args, spark_master=a.spark_master, python=a.python)
    log_path = a.work_dir / "logs" / f"{engine}-{job}{tag}-{n}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {engine} {job} {n:,}: {' '.join(cmd)}", flush=True)
    load_before = os.getloadavg()

    def progress(elapsed: float, p: Peaks) -> None:
        print(f"    ... {elapsed:.0f} s, {_peaks_text(p)}", flush=True)

    with open(log_path, "w") as log:
        peaks = PeakWatch(
            cmd,
            env=job_env(a.python, a.code_root),
            cwd=a.code_root,
            log=log,
            interval=a.sample_interval,
            script=f"jobs/{job}.py" if engine == "spark" else None,
            progress=progress,
        ).run()
    if peaks.returncode != 0:
        tail = log_path.read_text().splitlines()[-20:]
        raise BenchError(
            f"{engine} {job} {n} failed with exit code {peaks.returncode}; "
            f"the end of {log_path}:\n" + "\n".join(tail)
        )
    missing = [
        name
        for name, value in [
            ("the driver Python's peak", peaks.driver_python_rss_peak),
            ("the JVM's heap", peaks.jvm_heap_used_peak if engine == "spark" else 0),
        ]
        if value is None
    ]
    if missing:
        raise BenchError(
            f"{engine} {job} {n}: could not measure {' or '.join(missing)} "
            f"({peaks.samples} samples; {'; '.join(peaks.notes) or 'no jstat output'})"
        )
    print(f"    done in {peaks.wall_s:.1f} s, {_peaks_text(peaks)}", flush=True)
    return {
        "engine": engine,
        "job": job,
        "objects": n,
        "wall_s": round(peaks.wall_s, 2),
        "ms_per_object": round(1000 * peaks.wall_s / n, 4),
        "cpu_s": round(peaks.tree_cpu_s, 2),
        "cpu_ms_per_object": round(1000 * peaks.tree_cpu_s / n, 4),
        "driver_cpu_s": peaks.driver_python_cpu_s,
        "driver_cpu_ms_per_object": _per_object_ms(peaks.driver_python_cpu_s, n),
        "jvm_cpu_s": peaks.jvm_cpu_s,
        "reaped_cpu_s": peaks.reaped_cpu_s,
        "processes": peaks.tree_processes,
        "driver_python_rss_peak_mib": peaks.mib("driver_python_rss_peak"),
        "jvm_heap_used_peak_mib": peaks.mib("jvm_heap_used_peak"),
        "jvm_old_used_peak_mib": peaks.mib("jvm_old_used_peak"),
        "jvm_rss_peak_mib": peaks.mib("jvm_rss_peak"),
        "jvm_heap_samples": peaks.jvm_heap_samples,
        "samples": peaks.samples,
        "notes": peaks.notes,
        "command": cmd,
        "log": str(log_path),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def _per_object_ms(seconds: float | None, n: int) -> float | None:
    return None if seconds is None else round(1000 * seconds / n, 4)


def _peaks_text(p: Peaks) -> str:
    text = f"driver Python peak {p.mib('driver_python_rss_peak')} MiB"
    if p.jvm_pid is not None:
        text += (
            f", JVM heap used peak {p.mib('jvm_heap_used_peak')} MiB (old {p.mib('jvm_old_used_peak')} MiB)"
        )
    return (
        text
        + f", CPU {p.tree_cpu_s:.1f} s in {p.tree_processes} processes (driver {p.driver_python_cpu_s} s)"
    )


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine and job: the largest size's driver peaks and time per object over the smallest's
    (the issue's targets: peaks ≤ 1.3, time per object ≤ 1.2), wall and CPU time alike."""
    out = []
    for engine in ENGINES:
        for job in JOBS:
            rows = sorted(
                (r for r in results if r["engine"] == engine and r["job"] == job), key=lambda r: r["objects"]
            )
            if len(rows) < 2:
                continue
            small, large = rows[0], rows[-1]
            entry: dict[str, Any] = {
                "engine": engine,
                "job": job,
                "from": small["objects"],
                "to": large["objects"],
            }
            for key in RATIO_COLUMNS[4:]:  # the peaks are in MiB, the times per object in ms
                value = f"{key}_mib" if key.endswith("_peak") else key
                if small.get(value) and large.get(value) is not None:
                    entry[key] = round(large[value] / small[value], 2)
            out.append(entry)
    return out


def table(rows: list[dict[str, Any]], head: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("" if r.get(k) is None else str(r[k]) for k in head) + " |" for r in rows]
    return "\n".join(lines)


RUN_COLUMNS = (
    "engine",
    "job",
    "objects",
    "wall_s",
    "ms_per_object",
    "cpu_s",
    "cpu_ms_per_object",
    "driver_cpu_s",
    "driver_python_rss_peak_mib",
    "jvm_heap_used_peak_mib",
    "jvm_old_used_peak_mib",
)
RATIO_COLUMNS = (
    "engine",
    "job",
    "from",
    "to",
    "driver_python_rss_peak",
    "jvm_heap_used_peak",
    "jvm_old_used_peak",
    "ms_per_object",
    "cpu_ms_per_object",
    "driver_cpu_ms_per_object",
)


def _code_root(text: str) -> Path:
    root = Path(text).resolve()
    missing = [f"jobs/{job}.py" for job in JOBS if not (root / "jobs" / f"{job}.py").is_file()]
    if missing:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a source tree of the jobs: no {', '.join(missing)}"
        )
    return root


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Run from anywhere; the jobs run from the repository root with it on PYTHONPATH.",
    )
    p.add_argument(
        "--objects",
        "--sizes",
        dest="objects",
        type=int_list,
        nargs="+",
        default=[[1000, 10000]],
        help="objects per lake, comma- or space-separated (e.g. 100000,1000000); default 1000,10000",
    )
    p.add_argument(
        "--engines",
        type=names(ENGINES, "engines"),
        nargs="+",
        default=[list(ENGINES)],
        help="engines to run, comma- or space-separated, among spark and dask; default both",
    )
    p.add_argument(
        "--jobs",
        type=lambda t: [j for j in t.split(",") if j],
        default=list(JOBS),
        help="jobs to run, comma-separated (shard needs manifest before it); default manifest,shard",
    )
    p.add_argument("--classes", type=positive, default=100, help="classes in each lake (default 100)")
    p.add_argument(
        "--side",
        type=positive,
        default=8,
        help="side of the lake's PNGs, in pixels (default 8: tiny objects)",
    )
    p.add_argument(
        "--image-size", type=positive, default=32, help="the shard job's --image-size (default 32)"
    )
    p.add_argument("--num-shards", type=positive, default=4, help="the shard job's --num-shards (default 4)")
    p.add_argument(
        "--threads", type=positive, default=None, help="the shard job's --threads (default: the job's own)"
    )
    p.add_argument(
        "--partitions",
        type=positive,
        default=None,
        help="the shard job's --partitions: its preprocessing tasks (default: the job's own, one per "
        "2,000 rows); the same number at every size tells what grows per task from what grows per object",
    )
    p.add_argument("--spark-master", default="local[2]", help="spark-submit's --master (default local[2])")
    p.add_argument(
        "--scheduler",
        default=None,
        help="dask: a scheduler address to pass to the jobs (default: each job starts its own LocalCluster)",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the Python the Dask jobs and Spark's driver and workers run (default: this one)",
    )
    p.add_argument(
        "--sample-interval",
        type=float,
        default=0.1,
        help="seconds between memory samples (default 0.1; jstat ticks at twice this)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=ROOT / "benchmarks/results/lakes",
        help="where the lakes are built and kept between runs",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=ROOT / "benchmarks/results/work",
        help="where the datasets and the jobs' logs are written",
    )
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/jobs_scaling.json", help="the JSON written"
    )
    p.add_argument(
        "--code-root",
        type=_code_root,
        default=ROOT,
        help="the source tree whose jobs run (its jobs/ and its packages, first on PYTHONPATH), "
        "e.g. a worktree of an older commit to measure it with this script (default: this one)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the datasets written (default: removed after each size)"
    )
    g = p.add_argument_group("the shard plan alone (--plan-only)")
    g.add_argument(
        "--plan-only", action="store_true", help="run only the shard plan on synthetic counts, no lake"
    )
    g.add_argument(
        "--plan-rows",
        type=positive,
        default=100_000_000,
        help="rows of the synthetic channel (default 100M)",
    )
    g.add_argument(
        "--plan-classes", type=positive, default=1000, help="classes of the synthetic channel (default 1000)"
    )
    g.add_argument("--plan-shards", type=positive, default=8, help="shards of the plan (default 8)")
    g.add_argument(
        "--plan-rejects",
        type=at_least(0),
        default=10_000,
        help="rows rejected at random slots, for the repair (default 10000)",
    )
    g.add_argument(
        "--plan-sample-rows",
        type=positive,
        default=200_000,
        help="rows the workers' side is timed on, to give its cost per row (default 200000)",
    )
    g.add_argument(
        "--plan-through-engine",
        type=int_list,
        default=None,
        metavar="ROWS",
        help="instead: for each number of rows (comma-separated), write a synthetic manifest of that many "
        "rows in --plan-classes classes (benchmarks/plan_alone.py, kept in --cache-dir) and run "
        "the shard job on it with --plan-only and --num-shards --plan-shards, on each of --engines, "
        "under the same sampler as the jobs",
    )
    return p


class BenchError(RuntimeError):
    """A run that failed or could not be measured: reported as one ``error:`` line, exit 2."""


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except (BenchError, ValueError) as exc:
        print(f"jobs_scaling.py: error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    a = parser().parse_args(argv)
    a.objects = sorted({n for group in a.objects for n in group})
    a.engines = list(dict.fromkeys(e for group in a.engines for e in group))
    bad = [j for j in a.jobs if j not in JOBS]
    if bad or (a.jobs == ["shard"]):
        raise BenchError(f"--jobs must be manifest or manifest,shard, got {','.join(a.jobs)!r}")
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "code_root": str(a.code_root),
        "code_commit": _commit(a.code_root),
        "load_before": os.getloadavg(),
    }
    if a.plan_only:
        return _plan_only(a, meta)
    if a.plan_through_engine:
        return _plan_through_engine(a, meta)

    lakes = {}
    for n in a.objects:
        t = time.perf_counter()
        lakes[n] = build_lake(a.cache_dir, n, classes=a.classes, side=a.side)
        print(f"lake of {n:,} objects ready in {time.perf_counter() - t:.1f} s: {lakes[n]}", flush=True)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for engine in a.engines:
        for n, lake in lakes.items():
            out = a.work_dir / f"{engine}-{n}"
            shutil.rmtree(out, ignore_errors=True)
            results += [run_job(engine, job, n, lake, out, a) for job in a.jobs]
            if not a.keep:
                shutil.rmtree(out, ignore_errors=True)
    print(table(results, RUN_COLUMNS))
    found = ratios(results)
    if found:
        print(
            f"\nlargest / smallest size (targets: driver peaks ≤ 1.3, ms_per_object ≤ 1.2; cpu_: CPU of the job's process tree, driver_cpu_: of the driver Python alone)\n{table(found, RATIO_COLUMNS)}"
        )
    write_out(a.out, {**meta, "load_after": os.getloadavg(), "results": results, "ratios": found})
    return 0


def _plan_only(a: argparse.Namespace, meta: dict[str, Any]) -> int:
    from plan_alone import measure_plan

    print(
        f"the shard plan alone: {a.plan_rows:,} rows, {a.plan_classes} classes, {a.plan_shards} shards, "
        f"{a.plan_rejects} rejects ...",
        flush=True,
    )
    r = measure_plan(
        rows=a.plan_rows,
        classes=a.plan_classes,
        num_shards=a.plan_shards,
        rejects=a.plan_rejects,
        sample_rows=a.plan_sample_rows,
    )
    print(table([r], tuple(r)))
    write_out(a.out, {**meta, "load_after": os.getloadavg(), "plan": r})
    return 0


def _plan_through_engine(a: argparse.Namespace, meta: dict[str, Any]) -> int:
    from plan_alone import write_manifest

    results = []
    a.work_dir.mkdir(parents=True, exist_ok=True)
    for n in sorted(set(a.plan_through_engine)):
        root = a.cache_dir / f"manifest-{n}-c{a.plan_classes}"
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            t = time.perf_counter()
            write_manifest(root, rows=n, classes=a.plan_classes)
            (root / ".complete").touch()
            print(
                f"synthetic manifest of {n:,} rows written in {time.perf_counter() - t:.1f} s: {root}",
                flush=True,
            )
        args = ["--dataset", str(root), "--num-shards", str(a.plan_shards), "--plan-only"]
        results += [
            run_job(engine, "shard", n, None, root, a, args=args, tag="-plan-only") for engine in a.engines
        ]
    print(table(results, (*RUN_COLUMNS, "jvm_cpu_s")))
    found = [{**r, "job": "shard --plan-only"} for r in ratios(results)]
    if found:
        print(f"\nlargest / smallest size\n{table(found, RATIO_COLUMNS)}")
    write_out(a.out, {**meta, "load_after": os.getloadavg(), "plan_through_engine": results, "ratios": found})
    return 0


def _commit(root: Path) -> str | None:
    """The commit checked out at ``root`` (``None`` outside git)."""
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
