"""One benchmark, run by two versions of the code side by side: a git ref and the working tree.

    python benchmarks/code_ab.py --ref 34b7b12 --rounds 3 --metric ratios.shardloader_vs_ceiling_paired \\
        --metric median.shardloader -- benchmarks/loader_bench.py --images 2000 --repeats 3
    python benchmarks/code_ab.py --ref 34b7b12 --rounds 3 --metric shard_vs_ceiling --metric shard_s \\
        -- benchmarks/jobs_bench.py --engine spark --images 1000 --repeats 2

The ref is checked out with ``git worktree`` (the loader's built C extensions are copied into
it: the C sources must be the same). Every round runs the benchmark once with each version, in
fresh processes, the order alternating from round to round so that a slow spell of this shared
machine hits both; each run writes its JSON (``--out`` is added to the command), and the
``--metric`` paths (dotted keys into that JSON, an integer picks an item of a list; a list
at the end is reduced to its median) are printed
per version as the median over rounds, with each round's value, and the ratio tree / ref.
Exits 0; the verdict is the reader's (noise on a 2-core machine is a few percent).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _metric(data: Any, path: str) -> float:
    for key in path.split("."):
        data = data[int(key)] if isinstance(data, list) and key.lstrip("-").isdigit() else data[key]
    return float(statistics.median(data) if isinstance(data, list) else data)


def _run(code: Path, command: list[str], out: Path) -> dict[str, Any]:
    script, *args = command
    env_path = {"PYTHONPATH": str(code)}
    proc = subprocess.run(
        [sys.executable, str(code / script), *args, "--out", str(out)],
        cwd=code,
        env={**_environ(), **env_path},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed in {code}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit(
            "usage: code_ab.py --ref REF [--rounds N] --metric PATH ... -- benchmarks/X.py [args]"
        )
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", required=True, help="the git ref to compare the working tree with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--metric", action="append", required=True, help="a dotted path into the benchmark's JSON")
    p.add_argument("--out", type=Path, help="write every round's metrics as JSON here")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    results: dict[str, list[dict[str, float]]] = {"ref": [], "tree": []}
    with tempfile.TemporaryDirectory(prefix="code-ab-") as tmp:
        old = Path(tmp) / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), args.ref], cwd=ROOT, check=True)
        try:
            for built in (ROOT / "loaders").glob("_*.so"):
                shutil.copy2(built, old / "loaders" / built.name)
            for r in range(args.rounds):
                order = [("ref", old), ("tree", ROOT)]
                for name, code in order if r % 2 == 0 else order[::-1]:
                    data = _run(code, command, Path(tmp) / f"{name}-{r}.json")
                    results[name].append({m: _metric(data, m) for m in args.metric})
                    print(
                        f"round {r + 1}/{args.rounds} {name}: "
                        + ", ".join(f"{m} {v:.4g}" for m, v in results[name][-1].items()),
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    print(f"{'metric':48} {'ref':>10} {'tree':>10} {'tree/ref':>9}")
    for m in args.metric:
        ref = statistics.median(x[m] for x in results["ref"])
        tree = statistics.median(x[m] for x in results["tree"])
        print(f"{m:48} {ref:10.4g} {tree:10.4g} {tree / ref if ref else float('nan'):9.3f}")
    if args.out:
        args.out.write_text(
            json.dumps({"ref": args.ref, "command": command, "rounds": results}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
