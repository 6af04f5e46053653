"""Does a preparation cluster lift a training process that has too few cores?

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "A preparation
cluster".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli import run_checked
from _data import build_dataset
from _timing import alternate, paired, write_json

from loaders import ShardLoader
from loaders.batch import BatchTask

#: The loader's transform, by reference: the workers import this module (not the script's
#: ``__main__``) to find it.
TRANSFORM = "prep_bench:heavy"
#: Blur passes of :func:`heavy` per batch: its CPU per image (calibrated by this tool's report,
#: which prints it beside the model step's).
PASSES = 3


def heavy(
    images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A RandAugment-like cost on one thread: float conversion, a random brightness and contrast
    per image, and ``PASSES`` 5x5 blurs of the whole batch; back to uint8."""
    x = images.float()
    n = len(x)
    gain = 0.8 + 0.4 * torch.rand((n, 1, 1, 1), generator=generator)
    bias = torch.randint(-16, 17, (n, 1, 1, 1), generator=generator).float()
    x = x * gain + bias
    kernel = torch.full((3, 1, 5, 5), 1 / 25.0)
    for _ in range(PASSES):
        x = nn.functional.conv2d(nn.functional.pad(x, (2, 2, 2, 2), mode="replicate"), kernel, groups=3)
    return x.clamp(0, 255).to(torch.uint8).contiguous(memory_format=torch.channels_last), labels


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


class Step:
    """A CPU-bound training step: ``repeat`` SGD steps of a small CNN on the batch."""

    def __init__(self, repeat: int) -> None:
        self.net, self.repeat = _Net(), repeat
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.float() / 255
        for _ in range(self.repeat):
            self.opt.zero_grad()
            nn.functional.cross_entropy(self.net(x), labels % 10).backward()
            self.opt.step()


def cpu_per_image(fn: Any, images: torch.Tensor, labels: torch.Tensor, rounds: int = 3) -> float:
    fn(images, labels)
    began = time.thread_time()
    for _ in range(rounds):
        fn(images, labels)
    return (time.thread_time() - began) / rounds / len(images)


def calibrate(batch: int, size: int) -> tuple[int, float, float]:
    """The step's repeat count that makes it cost about what the transform costs per image, and
    both costs (CPU s per image, one thread)."""
    # The loader's layout (channels_last): a convolution on it runs another kernel than on NCHW
    images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    labels = torch.zeros(batch, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    transform = cpu_per_image(lambda x, y: heavy(x, y, gen), images, labels)
    one = cpu_per_image(Step(1), images, labels)
    repeat = max(1, round(transform / one))
    return repeat, transform, cpu_per_image(Step(repeat), images, labels)


def run(loader: ShardLoader, step: Step, epochs: int) -> float:
    """Images/s over ``epochs`` epochs after a warm-up one, the step on every batch."""
    for e in range(epochs + 1):
        if e == 1:
            began, images = time.perf_counter(), 0
        loader.set_epoch(e)
        for x, y in loader:
            step(x, y)
            if e:
                images += len(y)
    return images / (time.perf_counter() - began)


def wire_bytes(dataset: str, batch: int) -> tuple[float, float]:
    """Bytes per image a task carries to the worker and its batch back (pickled, as dask sends them)."""
    with ShardLoader(dataset, batch_size=batch, decoder="none") as loader:
        encoded = next(iter(loader))
    task = BatchTask(
        0, [bytes(t.numpy()) for t in encoded.images], encoded.labels.numpy(), encoded.labels.numpy() < 0,
        encoded.shards.numpy(), encoded.rows.numpy(),
    )  # fmt: skip
    with ShardLoader(dataset, batch_size=batch, transform=TRANSFORM) as loader:
        images, labels = next(iter(loader))
    back = pickle.dumps((images.contiguous(), labels), protocol=5)
    return len(pickle.dumps(task, protocol=5)) / batch, len(back) / batch


@contextlib.contextmanager
def cluster_on(core: int, tmp: Path) -> Iterator[str]:
    """A Dask scheduler and one worker process (one thread), both pinned to ``core``, started as
    their own processes (``dask scheduler``, ``dask worker``): nothing of the cluster runs in this
    process but the loader's client. Yields the scheduler's address."""
    pin = functools.partial(os.sched_setaffinity, 0, {core})
    file = tmp / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    cli = [sys.executable, "-m"]
    scheduler = subprocess.Popen(
        [*cli, "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
         "--scheduler-file", str(file)], preexec_fn=pin, **quiet,
    )  # fmt: skip
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        address = json.loads(file.read_text())["address"]
        here = Path(__file__).resolve().parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
        worker = subprocess.Popen(
            [*cli, "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-nanny", "--no-dashboard"],
            preexec_fn=pin, env=env, **quiet,
        )  # fmt: skip
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
        yield address
    finally:
        for proc in (worker, scheduler):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def doctor(root: Path, batch: int, *, core: int) -> dict[str, Any]:
    """``python -m loaders.doctor`` on the dataset with the benchmark's transform, on one core
    (as the local variant's training process): its bottleneck, headline and next steps."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
    cmd = [sys.executable, "-m", "loaders.doctor", "--dataset", str(root), "--transform", TRANSFORM]
    cmd += ["--threads", "1", "--batch-size", str(batch), "--seconds", "3", "--json"]
    pin = functools.partial(os.sched_setaffinity, 0, {core})
    report = json.loads(run_checked(cmd, "the doctor", env=env, preexec_fn=pin))
    return {
        "bottleneck": report["bottleneck"],
        "headline": report["headline"],
        "next_steps": [s["action"] for s in report["next_steps"]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="prep_bench.py")
    p.add_argument("--images", type=int, default=1024, help="images in the dataset (default 1024)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels (default 224)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    p.add_argument(
        "--epochs", type=int, default=1, help="timed epochs per run, after a warm-up one (default 1)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating (default 3)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs 2 cores: one for the training process, one for the cluster's worker")
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        build_dataset(root, images=args.images, size=args.size, quality=90)
        repeat, transform_s, step_s = calibrate(args.batch_size, args.size)
        print(
            f"CPU per image on one thread: transform {transform_s * 1e3:.2f} ms, model step {step_s * 1e3:.2f} ms"
        )
        with cluster_on(cores[1], Path(tmp)) as address:
            os.sched_setaffinity(0, {cores[0]})  # this process (its threads from now on) keeps one core
            common = dict(batch_size=args.batch_size, shuffle=True, seed=1, transform=TRANSFORM)
            rates: dict[str, list[float]] = {"local": [], "prep": []}
            with (
                ShardLoader(str(root), num_threads=1, **common) as local,
                ShardLoader(str(root), num_threads=2, prep=address, **common) as prep,
            ):
                for r in range(args.repeats):
                    order = alternate(["local", "prep"], r)
                    for name in order:
                        loader = local if name == "local" else prep
                        rates[name].append(run(loader, Step(repeat), args.epochs))
                        print(f"repeat {r + 1}/{args.repeats} {name:5s}: {rates[name][-1]:7.1f} images/s")
            os.sched_setaffinity(0, set(cores))
        to_worker, to_trainer = wire_bytes(str(root), args.batch_size)
        verdict = doctor(root, args.batch_size, core=cores[0])
        print(f"the doctor, on the training process's one core: {verdict['headline']}")
    local_rate, prep_rate = (statistics.median(rates[k]) for k in ("local", "prep"))
    ratio = paired(rates["prep"], rates["local"])
    print(
        f"\nlocal {local_rate:.1f} images/s, prep {prep_rate:.1f} images/s: prep / local {ratio:.2f} (paired median)"
    )
    print(f"bytes per image: {to_worker / 1e3:.1f} kB to the worker, {to_trainer / 1e3:.1f} kB back")
    result = {
        "config": vars(args) | {"out": str(args.out) if args.out else None, "step_repeat": repeat},
        "cpu_s_per_image": {"transform": transform_s, "step": step_s},
        "images_per_s": rates,
        "median": {"local": local_rate, "prep": prep_rate},
        "ratio_prep_vs_local": ratio,
        "bytes_per_image": {"to_worker": to_worker, "to_trainer": to_trainer},
        "doctor_local": verdict,
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
