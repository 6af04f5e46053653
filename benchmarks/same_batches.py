"""The loader's batches, states and resumes with the code at a git ref and with the working tree; compare.

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "The same batches
as another version of the code".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _cli import run_checked

ROOT = Path(__file__).resolve().parents[1]

#: A transform by reference (``sbtransforms:flip_some``), written beside the datasets: the same
#: module for both versions of the code.
_TRANSFORMS = """
import torch

def flip_some(images, labels, generator):
    flip = torch.rand(len(images), generator=generator) < 0.5
    images = images.clone()
    images[flip] = images[flip].flip(-1)
    return images, labels
"""

_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _case(
    sources: Any, world_size: int, *, elastic: Any = (), resume_at: int = 3, **options: Any
) -> dict[str, Any]:
    return dict(
        sources=sources, world_size=world_size, options=options, elastic=list(elastic), resume_at=resume_at
    )


def cases(data: Path, remote: str) -> dict[str, dict[str, Any]]:
    """The matrix: name -> {sources, world_size, options, resume_at (k), elastic: [(ws, bs)]}.

    ``sources`` is a dataset URI, or a list of ``[uri, weight]`` for a mixture; ``options`` are the
    loader's keywords without ``rank`` and ``world_size``; ``batch_size`` is per rank."""
    a, b, c = str(data / "dsA"), str(data / "dsB"), str(data / "dsC")
    ra, rb, rc = f"{remote}/dsA", f"{remote}/dsB", f"{remote}/dsC"
    cache = str(data / "cache-{version}-{case}-{rank}")
    flip = "sbtransforms:flip_some"
    return {
        "plain": _case(a, 1, batch_size=8, num_threads=2),
        "shuffle-2ranks": _case(a, 2, batch_size=8, shuffle=True, seed=3, shuffle_window=16, num_threads=2,
                                elastic=[(1, 16), (4, 4)]),
        "shuffle-3ranks-drop": _case(a, 3, batch_size=5, shuffle=True, seed=11, remainder="drop",
                                     drop_last=True, elastic=[(1, 15)]),
        "augment-crop-normalize": _case(a, 2, batch_size=8, shuffle=True, seed=5, augment=True, crop=24,
                                        normalize=_MEAN_STD, elastic=[(1, 16)]),
        "center-crop": _case(a, 1, batch_size=7, crop=20),
        "transform-ref": _case(a, 2, batch_size=8, shuffle=True, seed=2, transform=flip),
        "pillow": _case(a, 1, batch_size=8, decoder="pillow", shuffle=True),
        "encoded": _case(a, 2, batch_size=8, decoder="none", shuffle=True, seed=4),
        "validation": _case(a, 2, batch_size=4, channel="validation", resume_at=1),
        "remote": _case(ra, 2, batch_size=8, shuffle=True, seed=3, read_concurrency=3, elastic=[(1, 16)]),
        "remote-cache": _case(ra, 2, batch_size=8, shuffle=True, seed=3, cache_dir=cache),
        "mixture": _case([[a, 0.7], [b, 0.3]], 2, batch_size=6, shuffle=True, seed=1, samples_per_epoch=120,
                         elastic=[(1, 12), (3, 4)]),
        "mixture-augment": _case([[a, 0.5], [b, 0.5]], 1, batch_size=10, shuffle=True, seed=8, augment=True,
                                 crop=24),
        "mixture-passes": _case([[a, 0.4], [b, 0.6]], 2, batch_size=7, shuffle=True, seed=12,
                                samples_per_epoch=280, elastic=[(1, 14), (7, 2)]),
        "mixture-transform": _case([[a, 0.7], [b, 0.3]], 1, batch_size=9, shuffle=True, seed=6,
                                   transform=flip),
        "mixture-one-label-space": _case([[a, 0.6], [c, 0.4]], 2, batch_size=6, shuffle=True, seed=4,
                                         samples_per_epoch=150, elastic=[(1, 12), (3, 4)]),
        "mixture-one-label-space-remote": _case([[ra, 0.5], [rc, 0.5]], 1, batch_size=8, cache_dir=cache),
        "mixture-remote-cache": _case([[ra, 0.6], [rb, 0.4]], 2, batch_size=6, shuffle=True, seed=1,
                                      cache_dir=cache, elastic=[(1, 12)]),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The child: runs with one version of the code (PYTHONPATH), writes what it saw as JSON.


def _digest_batch(batch: Any) -> str:
    import torch

    h = hashlib.sha256()
    if isinstance(batch, tuple | list) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        for t in batch:
            h.update(f"{t.dtype}|{tuple(t.shape)}|{t.stride()}|".encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:24]
    # An EncodedBatch: its fields, in order, whatever they hold.
    for name in getattr(batch, "__dataclass_fields__", None) or getattr(batch, "_fields", ()):
        value = getattr(batch, name)
        if isinstance(value, torch.Tensor):
            h.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
            h.update(value.contiguous().numpy().tobytes())
        elif isinstance(value, list | tuple):
            for item in value:
                h.update(item.numpy().tobytes() if isinstance(item, torch.Tensor) else repr(item).encode())
        else:
            h.update(f"{name}|{value!r}".encode())
    return h.hexdigest()[:24]


def _loader(
    spec: dict[str, Any], rank: int, world_size: int, batch_size: int, version: str, case: str
) -> Any:
    from loaders import MixedLoader, ShardLoader

    options = dict(spec["options"], rank=rank, world_size=world_size, batch_size=batch_size)
    if "cache_dir" in options:
        options["cache_dir"] = options["cache_dir"].format(version=version, case=case, rank=rank)
    if isinstance(spec["sources"], list):
        return MixedLoader([tuple(s) for s in spec["sources"]], **options)
    options.pop("samples_per_epoch", None)
    return ShardLoader(spec["sources"], **options)


def _child(job: dict[str, Any]) -> dict[str, Any]:
    """``job``: {"mode": "run"|"resume", "version", "cases": {name: spec}, "states": {...}}."""
    out: dict[str, Any] = {}
    for case, spec in job["cases"].items():
        ws, bs = spec["world_size"], spec["options"]["batch_size"]
        got: dict[str, Any] = {}
        if job["mode"] == "run":
            for rank in range(ws):
                with _loader(spec, rank, ws, bs, job["version"], case) as ld:
                    epochs = []
                    for epoch in (0, 1, 2):
                        ld.set_epoch(epoch)
                        epochs.append([_digest_batch(b) for b in ld])
                    got[f"rank{rank}"] = {"len": len(ld), "epochs": epochs}
                with _loader(spec, rank, ws, bs, job["version"], case) as ld:
                    ld.set_epoch(1)
                    it = iter(ld)
                    for _ in range(spec["resume_at"]):
                        next(it)
                    got[f"rank{rank}"]["state"] = ld.state_dict()
                    it.close()
        else:
            state = job["states"][case]
            for rws, rbs in [(ws, bs), *spec["elastic"]]:
                for rank in range(rws):
                    with _loader(spec, rank, rws, rbs, job["version"], case) as ld:
                        ld.load_state_dict(state)
                        rest = [_digest_batch(b) for b in ld]
                        ld.set_epoch(state["epoch"] + 1)
                        following = [_digest_batch(b) for b in ld]
                        got[f"ws{rws}-rank{rank}"] = {"len": len(ld), "rest": rest, "next": following}
        out[case] = got
    return out


# ---------------------------------------------------------------------------------------------
# The parent: datasets, the store, the two versions, the comparison.


def _build(data: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.helpers.lake import write_lake

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, counts, shards, seed in (
        ("dsA", {"cat": 60, "dog": 50, "fox": 40, "owl": 30}, 2, 1),
        ("dsB", {"ant": 20, "bee": 16, "cat": 12}, 1, 2),
        ("dsC", {"cat": 14, "dog": 12, "fox": 10, "owl": 9}, 1, 3),  # dsA's labels: rows decode alone
    ):
        lake = data / f"lake-{name}"
        write_lake(lake, counts, size=(48, 40), fmt="JPEG", seed=seed)
        manifest = ["jobs.manifest", "--input", str(lake), "--output", str(data / name), "--seed", "7"]
        shard = [
            "jobs.shard",
            "--dataset",
            str(data / name),
            "--num-shards",
            str(shards),
            "--image-size",
            "32",
        ]
        for module, *args in (
            [*manifest, "--split-method", "stratified"],
            [*shard, "--row-group-size", "16KiB"],
        ):
            command = [sys.executable, "-m", module, "--engine", "local", *args]
            run_checked(command, f"building {name}", cwd=ROOT, env=env)


def _run_child(code: Path, job: dict[str, Any], work: Path, env: dict[str, str]) -> dict[str, Any]:
    name = f"{job['version']}-{job['mode']}"
    job_file, out_file = work / f"{name}-job.json", work / f"{name}-out.json"
    job_file.write_text(json.dumps(job))
    child_env = {**env, "PYTHONPATH": f"{code}{os.pathsep}{work}"}
    command = [sys.executable, __file__, "--child", str(job_file), "--child-out", str(out_file)]
    run_checked(command, f"the {name} run ({code})", cwd=code, env=child_env)
    return json.loads(out_file.read_text())


def _compare(what: str, ref: Any, tree: Any, path: str = "") -> list[str]:
    if isinstance(ref, dict) and isinstance(tree, dict):
        diffs = []
        for key in sorted(set(ref) | set(tree)):
            if key not in ref or key not in tree:
                diffs.append(f"{what}{path}.{key}: only in {'ref' if key in ref else 'tree'}")
            else:
                diffs += _compare(what, ref[key], tree[key], f"{path}.{key}")
        return diffs
    if isinstance(ref, list) and isinstance(tree, list) and ref != tree:
        if len(ref) != len(tree):
            return [f"{what}{path}: {len(ref)} items in the ref, {len(tree)} in the tree"]
        first = next(i for i, (x, y) in enumerate(zip(ref, tree, strict=True)) if x != y)
        return _compare(what, ref[first], tree[first], f"{path}[{first}]")
    return [] if ref == tree else [f"{what}{path}: ref {ref!r}, tree {tree!r}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", help="the git ref to compare the working tree with (e.g. 239e4ea)")
    p.add_argument(
        "--tree",
        type=Path,
        default=ROOT,
        help="the code to compare with the ref (default: this working tree; another checkout for tests)",
    )
    p.add_argument("--only", action="append", default=[], help="run only this case (repeatable)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--out", type=Path, help="write the per-case verdicts as JSON here")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.child_out.write_text(json.dumps(_child(json.loads(args.child.read_text()))))
        return 0
    if args.list:
        for name, spec in cases(Path("DATA"), "s3://bench").items():
            print(f"{name:24} world_size={spec['world_size']} {spec['options']}")
        return 0
    if not args.ref:
        p.error("--ref is required (the git ref to compare the working tree with)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _timing import ref_checkout
    from remote_store import RemoteStore

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="same-batches-") as tmp:
        work = Path(tmp)
        with ref_checkout(ROOT, args.ref, work / "ref-code") as old:
            data = work / "data"
            data.mkdir()
            (work / "sbtransforms.py").write_text(_TRANSFORMS)
            _build(data)
            print(f"datasets built in {time.monotonic() - start:.0f} s", flush=True)
            with RemoteStore(data, latency_ms=0, bandwidth=1_000_000_000) as store:
                env = {k: v for k, v in os.environ.items() if k != "LAKESHARD_CACHE_DIR"}
                env.update(store.environ())
                matrix = cases(data, store.uri().rstrip("/"))
                unknown = sorted(set(args.only) - set(matrix))
                if unknown:
                    p.error(f"unknown case(s) {unknown}; --list shows them")
                if args.only:
                    matrix = {k: v for k, v in matrix.items() if k in args.only}
                runs = {
                    version: _run_child(code, {"mode": "run", "version": version, "cases": matrix}, work, env)
                    for version, code in (("ref", old), ("tree", args.tree.resolve()))
                }
                states = {case: runs["ref"][case]["rank0"]["state"] for case in matrix}
                resumes = {
                    version: _run_child(
                        code,
                        {"mode": "resume", "version": version, "cases": matrix, "states": states},
                        work,
                        env,
                    )
                    for version, code in (("ref", old), ("tree", args.tree.resolve()))
                }
    verdicts: dict[str, list[str]] = {}
    for case in matrix:
        diffs = _compare(f"{case} run", runs["ref"][case], runs["tree"][case])
        diffs += _compare(f"{case} resume", resumes["ref"][case], resumes["tree"][case])
        verdicts[case] = diffs
        batches = sum(len(e) for r in runs["tree"][case].values() for e in r["epochs"])
        resumed = sum(len(r["rest"]) for r in resumes["tree"][case].values())
        print(
            f"{case:24} {'same' if not diffs else 'DIFFERENT'}: {batches} batches, "
            f"{resumed} resumed batches ({len(resumes['tree'][case])} resumed ranks)"
        )
        for line in diffs[:5]:
            print(f"    {line}")
    different = [c for c, d in verdicts.items() if d]
    print(
        f"{len(matrix) - len(different)} of {len(matrix)} cases the same as {args.ref} "
        f"({time.monotonic() - start:.0f} s)"
    )
    if args.out:
        args.out.write_text(json.dumps({"ref": args.ref, "cases": verdicts}, indent=2) + "\n")
    return 1 if different else 0


if __name__ == "__main__":
    raise SystemExit(main())
