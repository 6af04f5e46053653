"""Train a small CNN on a lakeshard dataset with DistributedDataParallel.

```
python -m loaders.train --dataset <URI> --epochs 5 --batch-size 256 --lr 0.01 --gamma 0.7 --output runs/pets
torchrun --nproc_per_node=2 -m loaders.train --dataset <URI> --conf conf/train.yaml ...
```

One process per rank (gloo on CPU, nccl with CUDA). Each rank streams its share of the train
channel with a :class:`~loaders.ShardLoader`; every epoch ends with the validation accuracy
(all ranks, all-reduced), and training ends with the test accuracy. Rank 0 writes
``<output>/checkpoint.pt`` (model, optimiser, scheduler, loader state, dataset version, metrics
so far) and ``<output>/metrics.json`` (per epoch: loss, validation accuracy, images/s and each
rank's share of step time spent waiting for data). ``--resume`` continues from a checkpoint,
mid-epoch included.
"""

from __future__ import annotations

import io
import logging
import os
import random
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
from lakeshard.errors import ConfigError, DatasetError
from loaders.batch import PAD_LABEL
from loaders.config import TrainConfig, parse_args
from loaders.model import SmallCNN
from loaders.shard_loader import ShardLoader, default_threads

__all__ = ["main", "train"]

log = logging.getLogger(__name__)

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


def _init_distributed(cfg: TrainConfig) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
        log.info("rank %d/%d joined the %s process group", rank, world, backend)
    return _Dist(rank, world, local_rank, local_world, device)


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


@torch.no_grad()
def evaluate(model: nn.Module, loader: ShardLoader, ctx: _Dist) -> float:
    """Accuracy over the whole channel: each rank scores its share, the counts are summed."""
    model.eval()
    correct = count = 0
    for images, labels in loader:
        images, labels = images.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
        valid = labels != PAD_LABEL
        pred = model(images).argmax(dim=1)
        correct += int((pred[valid] == labels[valid]).sum())
        count += int(valid.sum())
    correct_all, count_all = _all_reduce([correct, count], ctx)
    return correct_all / count_all if count_all else float("nan")


def _save(uri: str, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    storage.write_bytes_atomic(uri, buf.getvalue())


def train(cfg: TrainConfig, ctx: _Dist) -> dict[str, Any]:
    """Run the training; return the metrics (also written to ``<output>/metrics.json``)."""
    assert cfg.dataset is not None  # parse_args guarantees it
    torch.set_num_threads(default_threads(ctx.local_world_size))  # this rank's share of its CPUs
    _seed_everything(cfg.seed)
    if cfg.batch_size % ctx.world_size:
        raise ConfigError(f"batch_size {cfg.batch_size} (global) is not divisible by the world size {ctx.world_size}")
    per_rank = cfg.batch_size // ctx.world_size
    info = contract.read_dataset_info(cfg.dataset)
    labels = storage.read_json(contract.labels_uri(cfg.dataset))
    num_classes = len(labels)
    if num_classes != int(info.get("num_classes", num_classes)):
        raise DatasetError(f"labels.json has {num_classes} classes, dataset.json says {info['num_classes']}")
    image_size = int(info["image"]["size"])
    output = storage.normalize(cfg.output)
    checkpoint_uri, metrics_uri = storage.join(output, "checkpoint.pt"), storage.join(output, "metrics.json")

    common = dict(
        rank=ctx.rank, world_size=ctx.world_size, seed=cfg.seed, num_threads=cfg.num_threads,
        prefetch=cfg.prefetch, normalize=_NORMALIZE, pin_memory=ctx.device.type == "cuda",
        skip_bad_rows=cfg.skip_bad_rows, shuffle_window=cfg.shuffle_window,
    )  # fmt: skip
    train_loader = ShardLoader(
        cfg.dataset, channel="train", batch_size=per_rank, shuffle=True, drop_last=cfg.drop_last,
        augment=cfg.augment, **common,
    )  # fmt: skip
    eval_batch = cfg.eval_batch_size or per_rank
    val_loader = ShardLoader(cfg.dataset, channel="validation", batch_size=eval_batch, **common)
    test_loader = ShardLoader(cfg.dataset, channel="test", batch_size=eval_batch, **common)

    model: nn.Module = SmallCNN(num_classes, image_size, width=cfg.width).to(ctx.device)
    if cfg.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)

    history: list[dict[str, Any]] = []
    start_epoch = 0
    if cfg.resume:
        uri = checkpoint_uri if cfg.resume == "auto" else storage.normalize(cfg.resume)
        ckpt = torch.load(io.BytesIO(storage.read_bytes(uri)), map_location="cpu", weights_only=True)
        if ckpt["dataset_version"] != train_loader.dataset_version:
            raise DatasetError(
                f"refusing to resume from {uri}: it was trained on dataset version {ckpt['dataset_version']!r}, "
                f"{cfg.dataset} is version {train_loader.dataset_version!r}"
            )
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        train_loader.load_state_dict(ckpt["loader"])
        history = list(ckpt["metrics"])
        start_epoch = ckpt["loader"]["epoch"]
        step = ckpt["loader"]["batches_consumed"]
        if ckpt.get("epoch_done"):
            start_epoch, step = start_epoch + 1, 0
        log.info("resumed from %s at epoch %d, step %d", uri, start_epoch, step)

    ddp: nn.Module = model
    if ctx.active:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)

    def checkpoint(epoch_done: bool) -> None:
        if ctx.rank == 0:
            _save(checkpoint_uri, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "loader": train_loader.state_dict(),
                "dataset_version": train_loader.dataset_version, "epoch_done": epoch_done,
                "metrics": history, "config": asdict(cfg),
            })  # fmt: skip

    run = {"dataset": cfg.dataset, "dataset_version": train_loader.dataset_version, "world_size": ctx.world_size,
           "global_batch_size": cfg.batch_size, "config": asdict(cfg)}  # fmt: skip
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
                checkpoint(epoch_done=False)
        bar.close()
        scheduler.step()
        elapsed = time.perf_counter() - epoch_start
        loss_total, rows_total, images_total = _all_reduce([loss_sum, rows, images_seen], ctx)
        (slowest,) = _all_reduce([elapsed], ctx, dist.ReduceOp.MAX if ctx.active else None)
        shares = _all_gather(wait / (wait + compute) if wait + compute > 0 else 0.0, ctx)
        val_acc = evaluate(model, val_loader, ctx)
        history.append({
            "epoch": epoch, "loss": loss_total / rows_total if rows_total else float("nan"),
            "val_accuracy": val_acc, "images_per_s": images_total / slowest if slowest > 0 else 0.0,
            "data_wait_share": shares, "steps": len(train_loader) - first_step, "resumed_at_step": first_step,
            "lr": scheduler.get_last_lr()[0], "seconds": slowest,
            "skipped_rows": len(train_loader.skipped_rows),
        })  # fmt: skip
        log.log(
            logging.INFO if ctx.rank == 0 else logging.DEBUG,
            "epoch %d: loss %.4f, validation accuracy %.4f, %.0f images/s, data wait %s",
            epoch, history[-1]["loss"], val_acc, history[-1]["images_per_s"], [f"{s:.0%}" for s in shares],
        )  # fmt: skip
        checkpoint(epoch_done=True)
        if ctx.rank == 0:
            storage.write_json_atomic(metrics_uri, {**run, "epochs": history})

    test_acc = evaluate(model, test_loader, ctx)
    metrics = {**run, "epochs": history, "test_accuracy": test_acc}
    if ctx.rank == 0:
        storage.write_json_atomic(metrics_uri, metrics)
    for loader in (train_loader, val_loader, test_loader):
        loader.close()
    return metrics


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    ctx = _init_distributed(cfg)
    try:
        metrics = train(cfg, ctx)
    finally:
        if ctx.active and dist.is_initialized():
            dist.destroy_process_group()
    if ctx.rank == 0:
        epochs = metrics["epochs"]
        last = epochs[-1] if epochs else {}
        shares = last.get("data_wait_share", [])
        print(
            f"test accuracy {metrics['test_accuracy']:.4f} | "
            f"{last.get('images_per_s', float('nan')):.0f} images/s | "
            f"data wait {' '.join(f'{s:.0%}' for s in shares) or 'n/a'} (per rank) | "
            f"metrics: {storage.join(storage.normalize(cfg.output), 'metrics.json')}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
