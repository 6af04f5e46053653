"""Train a small CNN (or your model) on a lakeshard dataset with DistributedDataParallel.

```
python -m loaders.train --dataset <URI> --epochs 5 --batch-size 256 --lr 0.01 --gamma 0.7 --output runs/pets
torchrun --nproc_per_node=2 -m loaders.train --dataset <URI> --conf conf/train.yaml ...
```

One process per rank (gloo on CPU, nccl with CUDA). Each rank streams its share of the train
channel with a :class:`~loaders.ShardLoader`; every epoch ends with the validation accuracy
(all ranks, all-reduced: top-1 and per class), and training ends with the test accuracy. Rank 0
writes ``<output>/checkpoint.pt`` (model, optimiser, scheduler, loader state, dataset version,
metrics so far) and ``<output>/metrics.json`` (per epoch: loss, validation accuracy, images/s,
each rank's share of step time spent waiting for data, the real samples trained on and the
world sizes the epoch ran at; see ``docs/loader.md``).

The model is a :class:`~loaders.train.model.SmallCNN`, or yours with ``--model package.module:factory``
(:func:`~loaders.train.model.build_model`). ``--precision bf16`` runs the forward passes under
``torch.autocast(dtype=torch.bfloat16)``, on CUDA or on CPU; on CUDA the model is in
``channels_last`` memory format, as the loader's images are.

``--resume PATH`` continues from a checkpoint, mid-epoch included; ``--resume auto`` resumes
from ``<output>/checkpoint.pt`` if there is one and starts afresh otherwise, so a preemptible job
reruns one command line. The checkpoint may come from another number of ranks: the global
``--batch-size`` stays the same (it must divide by the new world size) and the rest of the
interrupted epoch is dealt to the new ranks, every sample exactly once (:mod:`loaders.elastic`);
its ``samples`` in ``metrics.json`` count the epoch's real rows before and after the resume.

SIGTERM (a spot reclaim, Kubernetes, Slurm, torchrun forwarding its own) or SIGUSR1 (Slurm's
``--signal`` warning), to any of the ranks, stops the run after the current step: the ranks agree
on the step (one all-reduce per training step and evaluation batch), rank 0 saves a mid-epoch
checkpoint (the state a ``--checkpoint-every`` checkpoint has; during an evaluation, the epoch's
trained state before it), logs one line saying where and how to resume, and every rank exits
with status 75 (:data:`~loaders.train.preemption.EXIT_PREEMPTED`); ``--resume auto`` then trains every
remaining sample exactly once (:mod:`loaders.train.preemption`).

A dataset without a validation (or test) channel trains without that evaluation: the log says
so, and ``metrics.json`` has ``null`` accuracies and the reason under ``skipped``.

Bad input (options, environment, dataset, checkpoint, a resume with another ``--model``,
``--width`` or ``--optimizer``, a model whose output does not fit the data, an ``--output`` that
cannot be written) is checked on every rank before the process group starts and before any
loader thread (:mod:`loaders.train.checks`); :func:`main` prints it as one
``python -m loaders.train: error: ...`` line and returns 2, with no traceback. The progress bar is drawn on a terminal only; a log gets the line
each epoch ends with.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from lakeshard import storage
from lakeshard.errors import ConfigError, PlatformError
from loaders.batch import PAD_LABEL
from loaders.shard_loader import ShardLoader, default_threads
from loaders.state import last_leg
from loaders.train.checks import EVAL_CHANNELS, TrainPlan, prepare
from loaders.train.config import TrainConfig, parse_args
from loaders.train.preemption import EXIT_PREEMPTED, Preempted, StopRequest, signal_name, stop_signals

__all__ = ["main", "train"]

log = logging.getLogger(__name__)

_PROG = "python -m loaders.train"

#: Images are normalised to [-1, 1] by the loader's decode threads.
_NORMALIZE = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


@dataclass(frozen=True, slots=True)
class _Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def active(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"environment variable {name} must be a non-negative integer, got {raw!r} (set by torchrun)")
    return value


def _world_from_env() -> tuple[int, int, int, int]:
    """``(rank, world_size, local_rank, local_world_size)`` as torchrun sets them (1 process
    without it)."""
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise ConfigError(f"environment variable WORLD_SIZE must be at least 1, got {world}")
    return _env_int("RANK", 0), world, _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world)


def _init_distributed(cfg: TrainConfig, world: tuple[int, int, int, int]) -> _Dist:
    rank, world_size, local_rank, local_world = world
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
        log.info("rank %d/%d joined the %s process group", rank, world_size, backend)
    return _Dist(rank, world_size, local_rank, local_world, device)


def _all_reduce(values: list[float], ctx: _Dist, op: Any = None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    if ctx.active:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def _all_gather(value: float, ctx: _Dist) -> list[float]:
    if not ctx.active:
        return [value]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over rows that count (padding is labelled PAD_LABEL)."""
    valid = int((labels != PAD_LABEL).sum())
    if valid == 0:  # keep the graph (DDP needs every parameter's gradient), contribute nothing
        return logits.sum() * 0.0, 0
    return F.cross_entropy(logits, labels, ignore_index=PAD_LABEL, reduction="sum") / valid, valid


def _autocast(ctx: _Dist, bf16: bool) -> torch.autocast:
    """The forward pass's precision: bfloat16 autocast, or none."""
    return torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)


def _agreed_signal(stop: StopRequest, ctx: _Dist) -> int:
    """The stop signal the ranks agree on: the largest any of them received, 0 for none. A
    collective (NOTE [ Stopping on a signal ] in :mod:`loaders.train.preemption`): every rank calls it
    at the same points, after each training step, evaluation batch and epoch."""
    if not ctx.active:
        return stop.signum
    (agreed,) = _all_reduce([float(stop.signum)], ctx, dist.ReduceOp.MAX)
    return int(agreed)


@torch.no_grad()
def evaluate(model: nn.Module, loader: ShardLoader, ctx: _Dist, class_names: tuple[str, ...], *,
             bf16: bool = False,
             stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """Top-1 accuracy over the whole channel, and per class: each rank scores its share, the
    counts are summed. ``{"top1": float, "per_class": {name: {"index", "correct", "count",
    "accuracy"}}}``; an accuracy over no rows is None (null in JSON). ``None`` if ``stop()`` (asked after each
    batch, on every rank: the loader yields as many batches on each) returned true."""
    model.eval()
    n = len(class_names)
    correct, count = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    for images, labels in loader:
        images, labels = images.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
        valid = labels != PAD_LABEL
        with _autocast(ctx, bf16):
            pred = model(images).argmax(dim=1)
        truth = labels[valid]
        count += torch.bincount(truth, minlength=n).cpu()
        correct += torch.bincount(truth[pred[valid] == truth], minlength=n).cpu()
        if stop is not None and stop():
            return None
    totals = _all_reduce([*correct.tolist(), *count.tolist()], ctx)
    correct_all, count_all = [int(v) for v in totals[:n]], [int(v) for v in totals[n:]]
    per_class = {
        name: {"index": i, "correct": correct_all[i], "count": count_all[i],
               "accuracy": correct_all[i] / count_all[i] if count_all[i] else None}
        for i, name in enumerate(class_names)
    }  # fmt: skip
    total = sum(count_all)
    return {"top1": sum(correct_all) / total if total else None, "per_class": per_class}


def _save(uri: str, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    storage.write_bytes_atomic(uri, buf.getvalue())


@dataclass(frozen=True, slots=True)
class _Loaders:
    """A rank's loaders; ``None`` for a channel the dataset does not have."""

    train: ShardLoader
    validation: ShardLoader | None
    test: ShardLoader | None

    def close(self) -> None:
        for loader in (self.train, self.validation, self.test):
            if loader is not None:
                loader.close()


def _loaders(cfg: TrainConfig, ctx: _Dist, plan: TrainPlan) -> _Loaders:
    dataset = str(cfg.dataset)
    common = dict(
        rank=ctx.rank, world_size=ctx.world_size, seed=cfg.seed, num_threads=cfg.num_threads,
        prefetch=cfg.prefetch, normalize=_NORMALIZE, pin_memory=ctx.device.type == "cuda",
        skip_bad_rows=cfg.skip_bad_rows, shuffle_window=cfg.shuffle_window,
        read_concurrency=cfg.read_concurrency, memory_budget=cfg.memory_budget, cache_dir=cfg.cache_dir,
        cache_limit=cfg.cache_limit,
    )  # fmt: skip
    train_loader = ShardLoader(
        dataset, channel="train", batch_size=plan.per_rank_batch, shuffle=True, drop_last=cfg.drop_last,
        augment=cfg.augment, **common,
    )  # fmt: skip
    eval_batch = cfg.eval_batch_size or plan.per_rank_batch
    val_loader, test_loader = (
        None if channel in plan.skipped else ShardLoader(dataset, channel=channel, batch_size=eval_batch, **common)
        for channel in EVAL_CHANNELS
    )
    return _Loaders(train_loader, val_loader, test_loader)


def train(cfg: TrainConfig, ctx: _Dist, plan: TrainPlan | None = None) -> dict[str, Any]:
    """Run the training; return the metrics (also written to ``<output>/metrics.json``).

    ``plan``: what :func:`~loaders.train.checks.prepare` checked (run here when not given).

    Raises:
        Preempted: SIGTERM or SIGUSR1 reached a rank (while this runs in the main thread):
            every rank stopped after the same step, rank 0 saved the checkpoint to resume from.
    """
    plan = plan or prepare(cfg, ctx.world_size)
    torch.set_num_threads(default_threads(ctx.local_world_size))  # this rank's share of its CPUs
    for channel, reason in plan.skipped.items():
        what = "validation after each epoch" if channel == "validation" else "the final test"
        log.log(_info_level(ctx), "skipping %s: %s", what, reason)
    loaders = _loaders(cfg, ctx, plan)
    try:
        with stop_signals() as stop:
            return _train(cfg, ctx, plan, loaders, stop)
    finally:
        loaders.close()


def _info_level(ctx: _Dist) -> int:
    """What every rank does alike is logged by rank 0 (the others log it at DEBUG)."""
    return logging.INFO if ctx.rank == 0 else logging.DEBUG


def _train(cfg: TrainConfig, ctx: _Dist, plan: TrainPlan, loaders: _Loaders,
           stop: StopRequest) -> dict[str, Any]:  # fmt: skip
    train_loader, val_loader, test_loader = loaders.train, loaders.validation, loaders.test
    info_level = _info_level(ctx)
    model = plan.model.to(ctx.device)  # holds the checkpoint's weights when resuming
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    bf16 = cfg.precision == "bf16"
    if cfg.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)

    history: list[dict[str, Any]] = []
    start_epoch = 0
    # The interrupted epoch's totals up to the checkpoint (all ranks): loss sum, samples, images.
    carried = [0.0, 0, 0]
    if plan.checkpoint is not None:
        ckpt = plan.checkpoint
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        train_loader.load_state_dict(ckpt["loader"])
        history = list(ckpt["metrics"])
        start_epoch = ckpt["loader"]["epoch"]
        step = ckpt["loader"]["batches_consumed"]
        if ckpt.get("epoch_done"):
            start_epoch, step = start_epoch + 1, 0
        elif (ckpt.get("epoch_partial") or {}).get("epoch") == start_epoch:
            part = ckpt["epoch_partial"]
            carried = [part["loss_sum"], part["samples"], part["images"]]
        saved = last_leg(ckpt["loader"])
        log.info("resumed from %s at epoch %d, step %d (saved on %d rank(s) x %d rows, now %d x %d)", plan.resume_uri,
                 start_epoch, step, saved.world_size, saved.batch_size, ctx.world_size, plan.per_rank_batch)  # fmt: skip
    elif cfg.resume == "auto":
        log.log(info_level, "--resume auto: no checkpoint at %s, starting a fresh run", plan.checkpoint_uri)

    ddp: nn.Module = model
    if ctx.active:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)

    def checkpoint(epoch_done: bool, partial: list[float] | None = None, epoch: int = 0) -> None:
        """Rank 0 saves; ``partial``: the epoch's totals so far (loss sum, samples, images)."""
        if ctx.rank == 0:
            so_far = None if partial is None else {
                "epoch": epoch, "loss_sum": partial[0], "samples": int(partial[1]), "images": int(partial[2]),
            }  # fmt: skip
            _save(plan.checkpoint_uri, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "loader": train_loader.state_dict(),
                "dataset_version": train_loader.dataset_version, "epoch_done": epoch_done,
                "epoch_partial": so_far, "metrics": history, "config": asdict(cfg),
            })  # fmt: skip

    agreed = 0

    def stopping() -> bool:
        nonlocal agreed
        agreed = _agreed_signal(stop, ctx)
        return agreed != 0

    def preempted(where: str) -> Preempted:
        """Once rank 0 has saved the checkpoint (every rank waits for it: torchrun stops the
        others as soon as one rank exits), the exception that ends the run."""
        _all_reduce([0.0], ctx)
        message = (f"{signal_name(agreed)}: saved the checkpoint {plan.checkpoint_uri} {where}; "
                   f"exiting with status {EXIT_PREEMPTED}: rerun with --resume auto to continue")  # fmt: skip
        log.log(logging.WARNING if ctx.rank == 0 else logging.DEBUG, "%s", message)
        return Preempted(message, signum=agreed, checkpoint=plan.checkpoint_uri)

    run = {"dataset": cfg.dataset, "dataset_version": train_loader.dataset_version, "world_size": ctx.world_size,
           "global_batch_size": cfg.batch_size, "config": asdict(cfg), "skipped": plan.skipped}  # fmt: skip
    # A bar on a terminal; a log (not a terminal) gets the line each epoch ends with instead.
    show_bar = ctx.rank == 0 and cfg.progress and sys.stderr.isatty()
    for epoch in range(start_epoch, cfg.epochs):
        train_loader.set_epoch(epoch)
        first_step = train_loader.state_dict()["batches_consumed"]
        steps = len(train_loader)
        ddp.train()
        wait = compute = loss_sum = 0.0
        rows = images_seen = 0
        epoch_start = tick = time.perf_counter()
        with tqdm(total=steps, initial=first_step, desc=f"epoch {epoch}", disable=not show_bar) as bar:
            for step, (images, labels) in enumerate(train_loader, start=first_step):
                got = time.perf_counter()
                wait += got - tick
                images = images.to(ctx.device, non_blocking=True)
                labels = labels.to(ctx.device, non_blocking=True)
                with _autocast(ctx, bf16):
                    loss, valid = _loss(ddp(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_value = float(loss.detach())
                loss_sum += loss_value * valid
                rows += valid
                images_seen += len(labels)
                tick = time.perf_counter()
                compute += tick - got
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}")
                stopped = stopping()
                every = cfg.checkpoint_every
                if stopped or (every and (step + 1) % every == 0 and step + 1 < steps):
                    here = _all_reduce([loss_sum, rows, images_seen], ctx)
                    checkpoint(epoch_done=False, partial=[a + b for a, b in zip(here, carried)],
                               epoch=epoch)
                if stopped:
                    raise preempted(f"at epoch {epoch}, step {step + 1} of {steps}")
        elapsed = time.perf_counter() - epoch_start
        loss_here, rows_here, images_total = _all_reduce([loss_sum, rows, images_seen], ctx)
        totals = [loss_here + carried[0], rows_here + carried[1], images_total + carried[2]]
        carried = [0.0, 0, 0]
        (slowest,) = _all_reduce([elapsed], ctx, dist.ReduceOp.MAX if ctx.active else None)
        shares = _all_gather(wait / (wait + compute) if wait + compute > 0 else 0.0, ctx)
        val = None
        if val_loader is not None:
            val = evaluate(model, val_loader, ctx, plan.class_names, bf16=bf16, stop=stopping)
        if val is None and val_loader is not None:  # stopped: save the epoch as it was before its validation
            checkpoint(epoch_done=False, partial=totals, epoch=epoch)
            raise preempted(f"at epoch {epoch}, step {steps} of {steps} (before its validation)")
        scheduler.step()  # after the validation: a checkpoint saved during it holds the epoch's scheduler
        val_acc = None if val is None else val["top1"]
        history.append({
            "epoch": epoch, "loss": totals[0] / totals[1] if totals[1] else None,
            "val_accuracy": val_acc, "validation": val, "images_per_s": images_total / slowest if slowest > 0 else 0.0,
            "data_wait_share": shares, "steps": steps - first_step, "resumed_at_step": first_step,
            "samples": int(totals[1]), "images": int(totals[2]), "legs": train_loader.state_dict()["legs"],
            "lr": scheduler.get_last_lr()[0], "seconds": slowest,
            "skipped_rows": len(train_loader.skipped_rows),
        })  # fmt: skip
        log.log(
            info_level, "epoch %d: loss %s, validation accuracy %s, %.0f images/s, data wait %s",
            epoch, "n/a" if history[-1]["loss"] is None else f"{history[-1]['loss']:.4f}",
            "n/a" if val_acc is None else f"{val_acc:.4f}", history[-1]["images_per_s"],
            [f"{s:.0%}" for s in shares],
        )  # fmt: skip
        checkpoint(epoch_done=True)
        if ctx.rank == 0:
            storage.write_json_atomic(plan.metrics_uri, {**run, "epochs": history})
        if stopping():  # a signal between two epochs: the checkpoint just saved resumes the next
            raise preempted(f"after epoch {epoch}")

    test = None
    if test_loader is not None:
        test = evaluate(model, test_loader, ctx, plan.class_names, bf16=bf16, stop=stopping)
    if test is None and test_loader is not None:  # the checkpoint of the last epoch resumes the test
        raise preempted(f"after epoch {cfg.epochs - 1} (before the final test)")
    metrics = {**run, "epochs": history, "test_accuracy": None if test is None else test["top1"], "test": test}
    if ctx.rank == 0:
        storage.write_json_atomic(plan.metrics_uri, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    """Parse, check, train; print the summary on rank 0. Returns 0; 2 after one
    ``python -m loaders.train: error: ...`` line on stderr (on every rank) for an error the
    platform raises on purpose: a bad option, environment, dataset, checkpoint, model or
    output; or 75 (:data:`~loaders.train.preemption.EXIT_PREEMPTED`) on every rank when SIGTERM or
    SIGUSR1 stopped the run after rank 0 saved a checkpoint (logged on rank 0)."""
    try:
        world = _world_from_env()
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{world[0]} %(levelname)s %(name)s: %(message)s")
        cfg = parse_args(argv)
        plan = prepare(cfg, world[1])
        ctx = _init_distributed(cfg, world)
        try:
            metrics = train(cfg, ctx, plan)
        finally:
            if ctx.active and dist.is_initialized():
                dist.destroy_process_group()
    except Preempted:
        return EXIT_PREEMPTED
    except PlatformError as exc:
        rank = os.environ.get("RANK")
        # One write, newline included: ranks share torchrun's stderr, and unbuffered (print
        # writes the text and the newline apart) their lines would interleave.
        sys.stderr.write(f"{_PROG}: error: {exc}" + (f" (rank {rank})" if rank is not None else "") + "\n")
        sys.stderr.flush()
        return 2
    if ctx.rank == 0:
        print(_summary(cfg, metrics))
    return 0


def _summary(cfg: TrainConfig, metrics: dict[str, Any]) -> str:
    epochs = metrics["epochs"]
    last = epochs[-1] if epochs else {}
    shares = last.get("data_wait_share", [])
    test = metrics["test_accuracy"]
    return (
        f"test accuracy {'n/a (no test channel)' if test is None else f'{test:.4f}'} | "
        f"{last.get('images_per_s', float('nan')):.0f} images/s | "
        f"data wait {' '.join(f'{s:.0%}' for s in shares) or 'n/a'} (per rank) | "
        f"metrics: {storage.join(storage.normalize(cfg.output), 'metrics.json')}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
