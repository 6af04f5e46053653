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

The model is a :class:`~loaders.model.SmallCNN`, or yours with ``--model package.module:factory``
(:func:`~loaders.model.build_model`). ``--precision bf16`` runs the forward passes under
``torch.autocast(dtype=torch.bfloat16)``, on CUDA or on CPU; on CUDA the model is in
``channels_last`` memory format, as the loader's images are.

``--resume PATH`` continues from a checkpoint, mid-epoch included; ``--resume auto`` resumes
from ``<output>/checkpoint.pt`` if there is one and starts afresh otherwise, so a preemptible job
reruns one command line. The checkpoint may come from another number of ranks: the global
``--batch-size`` stays the same (it must divide by the new world size) and the rest of the
interrupted epoch is dealt to the new ranks, every sample exactly once (:mod:`loaders.elastic`);
its ``samples`` in ``metrics.json`` count the epoch's real rows before and after the resume.

A dataset without a validation (or test) channel trains without that evaluation: the log says
so, and ``metrics.json`` has ``null`` accuracies and the reason under ``skipped``.

Bad input (options, environment, dataset, checkpoint) is checked on every rank before the
process group starts and before any loader thread; :func:`main` prints it as one
``python -m loaders.train: error: ...`` line and returns 2, with no traceback.
"""

from __future__ import annotations

import io
import logging
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from lakeshard import format as contract
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, LoaderError, PlatformError
from loaders.batch import PAD_LABEL
from loaders.config import TrainConfig, parse_args
from loaders.model import build_model
from loaders.shard_loader import ShardLoader, default_threads
from loaders.state import last_leg

__all__ = ["main", "train"]

log = logging.getLogger(__name__)

_PROG = "python -m loaders.train"

#: Images are normalised to [-1, 1] by the loader's decode threads.
_NORMALIZE = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))

#: The channels evaluated when the dataset has them: validation after each epoch, test at the end.
_EVAL_CHANNELS = ("validation", "test")


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


@dataclass(frozen=True, slots=True)
class _Plan:
    """What :func:`_prepare` checked before any expensive work, for :func:`train` to use."""

    per_rank_batch: int
    num_classes: int
    image_size: int
    class_names: tuple[str, ...]  # by label index
    model: nn.Module  # built (seeded) on the CPU, so a bad --model fails before any other work
    skipped: dict[str, str]  # evaluation channel -> why it is skipped
    checkpoint_uri: str
    metrics_uri: str
    resume_uri: str | None  # the checkpoint to resume from, None for a fresh run
    checkpoint: dict[str, Any] | None  # its contents


def _prepare(cfg: TrainConfig, world_size: int) -> _Plan:
    """Check the options against the world size, the dataset and the checkpoint; raise a
    :class:`PlatformError` naming the bad value. Reads ``dataset.json`` and the checkpoint only:
    every rank runs it before the process group starts, and fails alike."""
    if not cfg.dataset:
        raise ConfigError("TrainConfig.dataset is required")
    output = storage.normalize(cfg.output)
    checkpoint_uri = storage.join(output, "checkpoint.pt")
    resume_uri, checkpoint = _find_checkpoint(cfg, checkpoint_uri)
    if checkpoint is not None:
        _check_resumed_batch(cfg, world_size, resume_uri, checkpoint)
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"batch_size {cfg.batch_size} (global) is not divisible by the world size {world_size}: "
            f"each rank would get {cfg.batch_size / world_size:g} rows; pass a --batch-size that is a multiple of {world_size}"
        )
    info = contract.read_dataset_info(cfg.dataset)
    where = contract.dataset_json_uri(storage.normalize(cfg.dataset))
    channels, labels = info.channels, info.labels
    if "train" not in channels:
        raise DatasetError(f"{where} has no 'train' channel (it has: {', '.join(channels) or 'none'}); nothing to train on")
    if len(labels) < 2:
        raise DatasetError(
            f"{where} lists {len(labels)} class(es) ({', '.join(map(str, labels)) or 'none'}): "
            "a classifier needs at least 2; build the dataset from a lake with two or more label folders"
        )
    if set(labels.values()) != set(range(len(labels))):
        raise DatasetError(f"{where}: label indices must be 0..{len(labels) - 1}, one per label, got {list(labels.values())}")
    image_size = info.image.size
    skipped = {
        c: f"the dataset has no {c!r} channel (it has: {', '.join(channels)})" for c in _EVAL_CHANNELS if c not in channels
    }
    if cfg.precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"--precision bf16: this GPU ({torch.cuda.get_device_name()}) does not support bfloat16; use --precision fp32")
    version = info.dataset_version
    if checkpoint is not None and checkpoint.get("dataset_version") != version:
        raise DatasetError(
            f"refusing to resume from {resume_uri}: it was trained on dataset version {checkpoint.get('dataset_version')!r}, "
            f"{cfg.dataset} is version {version!r}"
        )
    _seed_everything(cfg.seed)  # the model's initial weights
    model = build_model(cfg.model, len(labels), image_size, width=cfg.width)
    return _Plan(
        per_rank_batch=cfg.batch_size // world_size, num_classes=len(labels), image_size=image_size,
        class_names=tuple(sorted(labels, key=labels.__getitem__)), model=model, skipped=skipped, checkpoint_uri=checkpoint_uri,
        metrics_uri=storage.join(output, "metrics.json"), resume_uri=resume_uri, checkpoint=checkpoint,
    )  # fmt: skip


def _find_checkpoint(cfg: TrainConfig, checkpoint_uri: str) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint ``--resume`` names and its contents; ``(None, None)`` for a fresh run."""
    if cfg.resume is None:
        return None, None
    if cfg.resume == "auto":
        if not storage.exists(checkpoint_uri):
            return None, None
        uri = checkpoint_uri
    else:
        uri = storage.normalize(cfg.resume)
        if not storage.exists(uri):
            raise ConfigError(f"--resume {cfg.resume}: no checkpoint at {uri} (pass --resume auto to start afresh when there is none)")
    try:
        ckpt = torch.load(io.BytesIO(storage.read_bytes(uri)), map_location="cpu", weights_only=True)
    except PlatformError:
        raise
    except Exception as exc:
        raise ConfigError(f"--resume: cannot load the checkpoint {uri}: {type(exc).__name__}: {exc}") from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "scheduler", "loader", "metrics"} <= set(ckpt):
        raise ConfigError(f"--resume: {uri} is not a checkpoint of loaders.train")
    return uri, ckpt


def _check_resumed_batch(cfg: TrainConfig, world_size: int, uri: str | None, ckpt: dict[str, Any]) -> None:
    """A resumed run keeps its checkpoint's global batch, on any world size that divides it (the
    loader deals the rest of the interrupted epoch to the new ranks: :mod:`loaders.elastic`)."""
    try:
        saved = last_leg(ckpt["loader"])
    except LoaderError as exc:
        raise ConfigError(f"--resume: {uri} holds no usable loader state: {exc}") from None
    g = saved.global_batch
    was = f"{saved.world_size} rank(s) x {saved.batch_size} rows"
    if cfg.batch_size != g:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} (global) differs from the global batch {g} ({was}) of the checkpoint {uri}: "
            f"a resumed run keeps its global batch; pass --batch-size {g}"
        )
    if g % world_size:
        works = ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)
        raise ConfigError(
            f"cannot resume {uri} on {world_size} ranks: its global batch {g} ({was}) is not divisible by {world_size}; "
            f"resume on a world size that divides {g} ({works})"
        )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


@torch.no_grad()
def evaluate(model: nn.Module, loader: ShardLoader, ctx: _Dist, class_names: tuple[str, ...], *,
             bf16: bool = False) -> dict[str, Any]:  # fmt: skip
    """Top-1 accuracy over the whole channel, and per class: each rank scores its share, the
    counts are summed. ``{"top1": float, "per_class": {name: {"index", "correct", "count",
    "accuracy"}}}``; an accuracy over no rows is NaN."""
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
    totals = _all_reduce([*correct.tolist(), *count.tolist()], ctx)
    correct_all, count_all = [int(v) for v in totals[:n]], [int(v) for v in totals[n:]]
    per_class = {
        name: {"index": i, "correct": correct_all[i], "count": count_all[i],
               "accuracy": correct_all[i] / count_all[i] if count_all[i] else float("nan")}
        for i, name in enumerate(class_names)
    }  # fmt: skip
    total = sum(count_all)
    return {"top1": sum(correct_all) / total if total else float("nan"), "per_class": per_class}


def _save(uri: str, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    storage.write_bytes_atomic(uri, buf.getvalue())


def train(cfg: TrainConfig, ctx: _Dist, plan: _Plan | None = None) -> dict[str, Any]:
    """Run the training; return the metrics (also written to ``<output>/metrics.json``).

    ``plan``: what :func:`_prepare` checked (run here when not given).
    """
    plan = plan or _prepare(cfg, ctx.world_size)
    dataset = str(cfg.dataset)
    torch.set_num_threads(default_threads(ctx.local_world_size))  # this rank's share of its CPUs
    info_level = logging.INFO if ctx.rank == 0 else logging.DEBUG
    for channel, reason in plan.skipped.items():
        log.log(info_level, "skipping %s: %s", "validation after each epoch" if channel == "validation" else "the final test", reason)

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
        for channel in _EVAL_CHANNELS
    )

    model = plan.model.to(ctx.device)
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
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        train_loader.load_state_dict(ckpt["loader"])
        history = list(ckpt["metrics"])
        start_epoch = ckpt["loader"]["epoch"]
        step = ckpt["loader"]["batches_consumed"]
        if ckpt.get("epoch_done"):
            start_epoch, step = start_epoch + 1, 0
        elif ckpt.get("epoch_partial", {}).get("epoch") == start_epoch:
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

    def checkpoint(epoch_done: bool, partial: dict[str, Any] | None = None) -> None:
        if ctx.rank == 0:
            _save(plan.checkpoint_uri, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "loader": train_loader.state_dict(),
                "dataset_version": train_loader.dataset_version, "epoch_done": epoch_done,
                "epoch_partial": partial, "metrics": history, "config": asdict(cfg),
            })  # fmt: skip

    run = {"dataset": cfg.dataset, "dataset_version": train_loader.dataset_version, "world_size": ctx.world_size,
           "global_batch_size": cfg.batch_size, "config": asdict(cfg), "skipped": plan.skipped}  # fmt: skip
    for epoch in range(start_epoch, cfg.epochs):
        train_loader.set_epoch(epoch)
        first_step = train_loader.state_dict()["batches_consumed"]
        ddp.train()
        bar = tqdm(total=len(train_loader), initial=first_step, desc=f"epoch {epoch}", disable=ctx.rank != 0 or not cfg.progress)
        wait = compute = loss_sum = 0.0
        rows = images_seen = 0
        epoch_start = tick = time.perf_counter()
        for step, (images, labels) in enumerate(train_loader, start=first_step):
            got = time.perf_counter()
            wait += got - tick
            images, labels = images.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
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
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < len(train_loader):
                so_far = [a + b for a, b in zip(_all_reduce([loss_sum, rows, images_seen], ctx), carried, strict=True)]
                checkpoint(epoch_done=False, partial={"epoch": epoch, "loss_sum": so_far[0], "samples": int(so_far[1]),
                                                      "images": int(so_far[2])})  # fmt: skip
        bar.close()
        scheduler.step()
        elapsed = time.perf_counter() - epoch_start
        loss_here, rows_here, images_total = _all_reduce([loss_sum, rows, images_seen], ctx)
        loss_total, rows_total, images_epoch = loss_here + carried[0], rows_here + carried[1], images_total + carried[2]
        carried = [0.0, 0, 0]
        (slowest,) = _all_reduce([elapsed], ctx, dist.ReduceOp.MAX if ctx.active else None)
        shares = _all_gather(wait / (wait + compute) if wait + compute > 0 else 0.0, ctx)
        val = None if val_loader is None else evaluate(model, val_loader, ctx, plan.class_names, bf16=bf16)
        val_acc = None if val is None else val["top1"]
        history.append({
            "epoch": epoch, "loss": loss_total / rows_total if rows_total else float("nan"),
            "val_accuracy": val_acc, "validation": val, "images_per_s": images_total / slowest if slowest > 0 else 0.0,
            "data_wait_share": shares, "steps": len(train_loader) - first_step, "resumed_at_step": first_step,
            "samples": int(rows_total), "images": int(images_epoch), "legs": train_loader.state_dict()["legs"],
            "lr": scheduler.get_last_lr()[0], "seconds": slowest,
            "skipped_rows": len(train_loader.skipped_rows),
        })  # fmt: skip
        log.log(
            info_level, "epoch %d: loss %.4f, validation accuracy %s, %.0f images/s, data wait %s",
            epoch, history[-1]["loss"], "n/a" if val_acc is None else f"{val_acc:.4f}", history[-1]["images_per_s"],
            [f"{s:.0%}" for s in shares],
        )  # fmt: skip
        checkpoint(epoch_done=True)
        if ctx.rank == 0:
            storage.write_json_atomic(plan.metrics_uri, {**run, "epochs": history})

    test = None if test_loader is None else evaluate(model, test_loader, ctx, plan.class_names, bf16=bf16)
    metrics = {**run, "epochs": history, "test_accuracy": None if test is None else test["top1"], "test": test}
    if ctx.rank == 0:
        storage.write_json_atomic(plan.metrics_uri, metrics)
    for loader in (train_loader, val_loader, test_loader):
        if loader is not None:
            loader.close()
    return metrics


def main(argv: list[str] | None = None) -> int:
    """Parse, check, train; print the summary on rank 0. Returns 0, or 2 after one
    ``python -m loaders.train: error: ...`` line on stderr (on every rank) for an error the
    platform raises on purpose: a bad option, environment, dataset or checkpoint."""
    try:
        world = _world_from_env()
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{world[0]} %(levelname)s %(name)s: %(message)s")
        cfg = parse_args(argv)
        plan = _prepare(cfg, world[1])
        ctx = _init_distributed(cfg, world)
        try:
            metrics = train(cfg, ctx, plan)
        finally:
            if ctx.active and dist.is_initialized():
                dist.destroy_process_group()
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
