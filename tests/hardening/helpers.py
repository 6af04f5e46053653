"""Builders and process helpers of the hardening tests: the bad-input corpus, running and
killing job subprocesses by process group, and the comparable digest of a dataset."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lakeshard import storage
from lakeshard.format import read_dataset_info, read_manifest_info, rejects_uri
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import read_table, shard_tables
from tests.helpers.lake import bad_objects, encode, exif_rotated_jpeg, make_image

__all__ = [
    "BIN",
    "REPO",
    "bomb_png",
    "corpus",
    "dataset_digest",
    "job_env",
    "kill_group",
    "manifest_digest",
    "run_until",
]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def local_job(module: str, *args: str) -> list[str]:
    """The command line of ``python -m <module> --engine local <args>`` (a job, as users run it)."""
    return [sys.executable, "-m", module, "--engine", "local", *args]


def run_local_job(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run :func:`local_job` to its end (with :func:`job_env`), its output captured."""
    return subprocess.run(
        local_job(module, *args), env=job_env(), capture_output=True, text=True, timeout=300
    )


def one_error_line(done: subprocess.CompletedProcess[str], prog: str) -> str:
    """The one ``<prog>: error: ...`` line of a job that failed as the commands fail: exit 2,
    no traceback."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"{prog}: error: "), done.stderr
    return errors[0]


def job_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(REPO),
        **extra,
    }
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return env


# -- processes ---------------------------------------------------------------------------------
def kill_group(proc: subprocess.Popen, *, sig: int = signal.SIGKILL) -> None:
    """Kill the process group ``proc`` leads (started with ``start_new_session=True``: the
    Python driver, Spark's JVM and its Python workers) and wait until none of it is left."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process group {proc.pid} still alive 30 s after SIGKILL")


def run_until(
    cmd: list[str],
    *,
    env: dict[str, str],
    log: Path,
    kill_after: float | None,
    timeout: float = 300,
    kill_when: Callable[[], bool] | None = None,
) -> tuple[int | None, float]:
    """Run ``cmd`` in its own process group, output appended to ``log``. Kill the group with
    SIGKILL after ``kill_after`` seconds, or as soon as ``kill_when()`` is true (checked every
    20 ms), if it is still running. Returns ``(returncode or None if killed, seconds)``."""
    with open(log, "ab") as out:
        out.write(f"\n=== {' '.join(cmd)} (kill after {kill_after})\n".encode())
        out.flush()
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            if kill_when is not None:
                deadline = start + (kill_after if kill_after is not None else timeout)
                while proc.poll() is None and time.monotonic() < deadline and not kill_when():
                    time.sleep(0.02)
                if proc.poll() is None:
                    kill_group(proc)
                    return None, time.monotonic() - start
                return proc.returncode, time.monotonic() - start
            rc = proc.wait(timeout=kill_after if kill_after is not None else timeout)
            return rc, time.monotonic() - start
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None, time.monotonic() - start
        finally:
            if proc.poll() is None:
                kill_group(proc)


# -- comparing datasets --------------------------------------------------------------------------
def _table_rows(uri: str, drop: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    t = read_table(uri)
    return t.drop_columns([c for c in drop if c in t.column_names]).to_pylist()


def manifest_digest(root: str) -> dict[str, Any]:
    """What the manifest job wrote, comparable across runs."""
    root = storage.normalize(root)
    marker = read_manifest_info(root)
    out: dict[str, Any] = {
        "marker": marker,
        "labels": json.loads(storage.read_bytes(storage.join(root, "labels.json"))),
    }
    for name in ["all", "rejects", *marker.split]:
        out[name] = read_channel(root, name).to_pylist()
    return out


def dataset_digest(root: str) -> dict[str, Any]:
    """dataset.json minus ``created_at``/``engine``/``build`` and shard paths' version folder, every shard's rows, the shard rejects and
    the manifests: equal digests mean equal datasets."""
    root = storage.normalize(root)
    info = json.loads(storage.read_bytes(storage.join(root, "dataset.json")))
    info = {k: v for k, v in info.items() if k not in ("created_at", "engine", "build")}
    for entry in info["channels"].values():  # the same dataset, whichever version folder (S3) holds it
        for shard in entry["shards"]:
            shard["path"] = re.sub(r"^shards/v=[^/]+/", "shards/", shard["path"])
    info["rejects_path"] = re.sub(r"^shards/v=[^/]+/", "shards/", info["rejects_path"])
    shards = {c: [t.to_pylist() for t in shard_tables(root, c, info["num_shards"])] for c in info["channels"]}
    rejects = _table_rows(rejects_uri(root, read_dataset_info(root)))
    return {"info": info, "shards": shards, "shard_rejects": rejects, "manifest": manifest_digest(root)}


# -- the bad-input corpus ------------------------------------------------------------------------
def bomb_png(side: int = 12_000) -> bytes:
    """A ``side``×``side`` RGB PNG of one colour, written row by row (never held decoded):
    144 M pixels for the default, compressing to a few hundred KiB."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    comp = zlib.compressobj(9)
    row = b"\x00" + b"\x40\x80\xc0" * side
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def corpus(seed: int = 3) -> dict[str, bytes]:
    """Every kind of bad or awkward object we can make, as key -> bytes, under classes that are
    otherwise healthy. The key says what must happen: ``ok_`` reaches a channel (and a shard,
    unless dropped), ``bad_`` is rejected with a reason. Keys with ``/../`` only exist on S3."""
    objs = {f"cls_a/{k.split('/', 1)[1]}": v for k, v in bad_objects(seed).items()}
    good = make_image(seed, size=(50, 30))
    objs.update(
        {
            "cls_a/ok_upright_probe.jpg": exif_rotated_jpeg(),
            "cls_a/ok_tall.png": encode(make_image(seed + 1, size=(3, 1500)), "PNG"),
            "cls_a/ok_gray.png": encode(good.convert("L"), "PNG"),
            "cls_a/ok_la.png": encode(good.convert("LA"), "PNG"),
            "cls_a/ok_gif.gif": encode(good.convert("P"), "GIF"),
            "cls_a/ok_webp.webp": encode(good, "WEBP"),
            "cls_a/ok_bmp.bmp": encode(good, "BMP"),
            "cls_a/ok_jpeg_named.png": encode(good, "JPEG"),
            "cls_a/ok_no_extension": encode(good, "PNG"),
            "cls_a/ok_UPPER.JPG": encode(good, "JPEG"),
            "cls_a/sub dir/ok 日本語.png": encode(make_image(seed + 2), "PNG"),
            "cls_a/bad_bomb.png": bomb_png(),
            "cls_a/bad_png_header_only.png": encode(good, "PNG")[:40],
            "cls_a/bad_html.jpg": b"<html><body>403 Forbidden</body></html>",
            "cls_a/bad_jpeg_soi_only.jpg": b"\xff\xd8\xff\xe0" + b"\x00" * 60,
            "cls_a/bad_gzip.png": zlib.compress(b"x" * 100),
            "cls_a/.hidden_ok.png": encode(make_image(seed + 3), "PNG"),
            # A class with a single image, and a class whose label is unicode with a space.
            "solo/ok_only.png": encode(make_image(seed + 4), "PNG"),
            **{f"ünï cls/ok_{i}.png": encode(make_image(seed + 10 + i), "PNG") for i in range(10)},
            # An object above the label level: no label.
            "bad_stray_top.png": encode(good, "PNG"),
            # `..` in the key (S3 only: no local filesystem holds such a path).
            "cls_b/../bad_dotdot.png": encode(good, "PNG"),
            "cls_b/./bad_dot.png": encode(good, "PNG"),
            "cls_b//bad_empty_component.png": encode(good, "PNG"),
        }
    )
    return objs
