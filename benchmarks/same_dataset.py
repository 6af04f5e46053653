"""Build one synthetic lake with the code at a git ref and with the working tree; compare.

    python benchmarks/same_dataset.py --ref HEAD~3 [--engine local,spark] [--images 600]

Both builds run the same command lines (`python -m jobs.manifest`, `python -m jobs.shard`) in
fresh processes, each from its own checkout (the ref through `git worktree`), on the same lake.
Prints and checks: `dataset_version`, `labels.json`, every manifest table (rows), every shard
file's bytes (sha256) and the shard rejects; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import run_checked
from _timing import ref_checkout

ROOT = Path(__file__).resolve().parents[1]


def _lake(root: Path, images: int) -> None:
    from tests.helpers.lake import bad_objects, encode, make_image

    classes = ["cat", "dog", "fox", "owl"]
    for i in range(images):
        label = classes[i % len(classes)]
        sub = root / label / (f"b{i % 3}" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        fmt = "JPEG" if i % 3 else "PNG"
        (sub / f"img_{i:05d}.{fmt.lower()[:3]}").write_bytes(
            encode(make_image(i, size=(64 + i % 40, 48 + i % 30)), fmt)
        )
    for name, data in bad_objects().items():
        path = root / "cat" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _run(code: Path, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(code), "SPARK_LOCAL_IP": "127.0.0.1"}
    run_checked([sys.executable, *args], f"{' '.join(args[:2])} ({code})", cwd=code, env=env)


def _build(code: Path, lake: Path, out: Path, engine: str) -> None:
    common = ["--engine", engine, "--max-reject-fraction", "0.2"]
    split = ["--split", "train=0.7,validation=0.2,test=0.1", "--seed", "5"]
    _run(code, ["-m", "jobs.manifest", *common, "--input", str(lake), "--output", str(out), *split])
    shard = ["--num-shards", "3", "--image-size", "32", "--remainder", "pad"]
    _run(code, ["-m", "jobs.shard", *common, "--dataset", str(out), *shard])


def _digest(out: Path) -> dict:
    info = json.loads((out / "dataset.json").read_text())
    shards = {}
    for channel, entry in info["channels"].items():
        for shard in entry["shards"]:
            data = (out / shard["path"]).read_bytes()
            shards[f"{channel}/{Path(shard['path']).name}"] = hashlib.sha256(data).hexdigest()
    manifests = {}
    for folder in sorted((out / "manifests").iterdir()):
        if folder.is_dir() and folder.name != "sagemaker":
            rows = [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
            manifests[folder.name] = hashlib.sha256(
                json.dumps(rows, default=str, sort_keys=True).encode()
            ).hexdigest()
    rejects = pq.read_table(out / info["rejects_path"]).to_pylist()
    return {
        "dataset_version": info["dataset_version"],
        "labels": (out / "labels.json").read_text(),
        "shards": shards,
        "manifests": manifests,
        "rejects": hashlib.sha256(json.dumps(rejects, default=str, sort_keys=True).encode()).hexdigest(),
        "counts": info["counts"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", required=True, help="the git ref to compare the working tree with")
    p.add_argument("--engine", default="local", help="comma-separated engines (local, spark, dask)")
    p.add_argument("--images", type=int, default=400)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="same-dataset-") as tmp:
        work = Path(tmp)
        with ref_checkout(ROOT, args.ref, work / "old-code", extensions=False) as old:
            lake = work / "lake"
            _lake(lake, args.images)
            same = True
            for engine in args.engine.split(","):
                digests = {}
                for name, code in (("ref", old), ("tree", ROOT)):
                    out = work / f"{name}-{engine}"
                    _build(code, lake, out, engine)
                    digests[name] = _digest(out)
                ok = digests["ref"] == digests["tree"]
                same &= ok
                d = digests["tree"]
                print(
                    f"{engine}: {'same' if ok else 'DIFFERENT'}: dataset_version {digests['ref']['dataset_version']} "
                    f"-> {d['dataset_version']}, {len(d['shards'])} shard files, counts {d['counts']}"
                )
                if not ok:
                    for key in digests["ref"]:
                        if digests["ref"][key] != digests["tree"][key]:
                            print(f"  differs: {key}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
