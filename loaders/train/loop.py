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
world sizes the epoch ran at; see ``docs/training.md``).

The model is a :class:`~loaders.train.model.SmallCNN`, or yours with ``--model package.module:factory``
(:func:`~loaders.train.model.build_model`). ``--precision bf16`` runs the forward passes under
``torch.autocast(dtype=torch.bfloat16)``, on CUDA or on CPU; on CUDA the model is in
``channels_last`` memory format, as the loader's images are.

``--resume PATH`` continues from a checkpoint, mid-epoch included; ``--resume auto`` resumes
from ``<output>/checkpoint.pt`` if there is one and starts afresh otherwise, so a preemptible job
reruns one command line. The checkpoint may come from another number of ranks: the global
``--batch-size`` stays the same (it must divide by the new world size) and the rest of the
interrupted epoch is dealt to the new ranks, every sample exactly once (:mod:`loaders._internal.elastic`);
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

import logging
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lakeshard import storage
from lakeshard.errors import ConfigError, PlatformError
from lakeshard.format.label_columns import MULTI_LABEL
from lakeshard.settings import command_name
from loaders.shard_loader import default_threads
from loaders.train.average_precision import AveragePrecision, evaluate_multi_label
from loaders.train.checkpoint import resume, save_checkpoint
from loaders.train.checks import TrainPlan, prepare
from loaders.train.config import TrainConfig, parse_args
from loaders.train.evaluation import Accuracy, evaluate
from loaders.train.export import Exporter
from loaders.train.metrics import EpochTotals
from loaders.train.preemption import EXIT_PREEMPTED, AgreedStop, Preempted, StopRequest, stop_signals
from loaders.train.records import record_epoch, write_metrics
from loaders.train.session import Loaders, Run, make_optimizer, on_device, open_loaders, wrap_ddp
from loaders.train.steps import Trained, train_epoch
from loaders.train.world import Ranks, World, any_rank, info_level

__all__ = ["main", "train"]

log = logging.getLogger(__name__)

_PROG = "python -m loaders.train"


def _init_distributed(cfg: TrainConfig, ranks: Ranks) -> World:
    """This process's device (its local GPU, else the CPU), in the process group when there are
    several ranks or torchrun started it."""
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{ranks.local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    grouped = ranks.world_size > 1 or ranks.launched
    if grouped:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
        log.info("rank %d/%d joined the %s process group", ranks.rank, ranks.world_size, backend)
    return World(ranks.rank, ranks.world_size, ranks.local_rank, ranks.local_world_size, device, grouped)


def train(cfg: TrainConfig, world: World, plan: TrainPlan | None = None) -> dict[str, Any]:
    """Run the training; return the metrics (also written to ``<output>/metrics.json``).

    ``plan``: what :func:`~loaders.train.checks.prepare` checked (run here when not given).

    Raises:
        Preempted: SIGTERM or SIGUSR1 reached a rank (while this runs in the main thread):
            every rank stopped after the same step, rank 0 saved the checkpoint to resume from.
    """
    plan = plan or prepare(cfg, world.world_size)
    torch.set_num_threads(default_threads(world.local_world_size))  # this rank's share of its CPUs
    for channel, reason in plan.skipped.items():
        what = "validation after each epoch" if channel == "validation" else "the final test"
        log.log(info_level(world), "skipping %s: %s", what, reason)
    loaders = open_loaders(cfg, world, plan)
    exporter: Exporter | None = None
    try:
        exporter = _exporter(cfg, world)
        with stop_signals() as request:
            return _train(cfg, world, plan, loaders, request, exporter)
    except Preempted as stopped:  # every rank stopped after the same step; rank 0 says where
        log.log(logging.WARNING if world.rank == 0 else logging.DEBUG, "%s", stopped)
        raise
    finally:
        loaders.close()
        if exporter is not None:
            exporter.close()


def _exporter(cfg: TrainConfig, world: World) -> Exporter | None:
    """The exporter of ``--metrics-port`` / ``--tensorboard-dir`` (rank 0 serves; every rank
    checks the packages), agreed on by every rank: one rank failing to start it (a port in use)
    stops them all with its error line, rather than leaving the others to wait for it."""
    if cfg.metrics_port is None and cfg.tensorboard_dir is None:
        return None
    exporter, error = None, None
    try:
        exporter = Exporter(
            port=cfg.metrics_port, tensorboard_dir=cfg.tensorboard_dir, rank=world.rank, addr=cfg.metrics_host
        )
    except PlatformError as exc:
        error = exc
    failed = any_rank(error is not None, world)
    if error is not None:
        raise error
    assert exporter is not None  # no error: this rank's started
    if failed:
        exporter.close()
        raise ConfigError("another rank could not start the metrics exporter (its line says why)")
    return exporter


def _train(
    cfg: TrainConfig,
    world: World,
    plan: TrainPlan,
    loaders: Loaders,
    request: StopRequest,
    exporter: Exporter | None = None,
) -> dict[str, Any]:
    """Set up, resume, then train, validate, record and checkpoint each epoch; test at the end."""
    model = on_device(plan.model, world)  # holds the checkpoint's weights when resuming
    optimizer = make_optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    start = resume(cfg, world, plan, optimizer=optimizer, scheduler=scheduler, loader=loaders.train)
    run = Run(
        cfg,
        world,
        plan,
        loaders,
        model,
        wrap_ddp(model, world),
        optimizer,
        scheduler,
        AgreedStop(request, world, plan.checkpoint_uri),
        start.history,
        exporter,
    )
    carried = start.carried
    for epoch in range(start.epoch, cfg.epochs):
        trained = train_epoch(run, epoch, carried)
        carried = EpochTotals()
        validation = _validate(run, epoch, trained)
        run.scheduler.step()  # after the validation: a checkpoint saved during it holds the epoch's scheduler
        record_epoch(run, epoch, trained, validation)
        save_checkpoint(run, epoch_done=True)
        write_metrics(run)
        if run.stop.agreed():  # a signal between two epochs: the checkpoint just saved resumes the next
            raise run.stop.preempted(f"after epoch {epoch}")
    return _test(run)


def _evaluate(run: Run, loader: Any) -> Accuracy | AveragePrecision | None:
    """A channel's accuracy, or a multi-label dataset's average precision (None: stopped)."""
    score = evaluate_multi_label if run.plan.task == MULTI_LABEL else evaluate
    return score(run.model, loader, run.world, run.plan.class_names, bf16=run.bf16, stop=run.stop.agreed)


def _validate(run: Run, epoch: int, trained: Trained) -> Accuracy | AveragePrecision | None:
    """The validation accuracy (or average precision) after epoch ``epoch`` (None without the
    channel). A stop signal saves the epoch as it was before its validation and raises
    :class:`Preempted`."""
    loader = run.loaders.validation
    if loader is None:
        return None
    accuracy = _evaluate(run, loader)
    if accuracy is None:
        save_checkpoint(run, epoch_done=False, partial=trained.totals.to_checkpoint(epoch))
        steps = trained.steps
        raise run.stop.preempted(f"at epoch {epoch}, step {steps} of {steps} (before its validation)")
    return accuracy


def _test(run: Run) -> dict[str, Any]:
    """The final test (if the dataset has a test channel), and the metrics with it. A stop signal
    raises :class:`Preempted`: the last epoch's checkpoint resumes the test."""
    loader = run.loaders.test
    if loader is None:
        return write_metrics(run, test_accuracy=None, test=None)
    test = _evaluate(run, loader)
    if test is None:
        raise run.stop.preempted(f"after epoch {run.cfg.epochs - 1} (before the final test)")
    top1 = test.top1 if isinstance(test, Accuracy) else None
    return write_metrics(run, test_accuracy=top1, test=test.to_json())


def main(argv: list[str] | None = None) -> int:
    """Parse, check, train; print the summary on rank 0. Returns 0; 2 after one
    ``python -m loaders.train: error: ...`` line on stderr (on every rank) for an error the
    platform raises on purpose: a bad option, environment, dataset, checkpoint, model or
    output; or 75 (:data:`~loaders.train.preemption.EXIT_PREEMPTED`) on every rank when SIGTERM or
    SIGUSR1 stopped the run after rank 0 saved a checkpoint (logged on rank 0)."""
    try:
        ranks = Ranks.from_env()
        line = f"%(asctime)s rank{ranks.rank} %(levelname)s %(name)s: %(message)s"
        logging.basicConfig(level=logging.INFO, format=line)
        cfg = parse_args(argv)
        plan = prepare(cfg, ranks.world_size)
        world = _init_distributed(cfg, ranks)
        try:
            metrics = train(cfg, world, plan)
        finally:
            if world.active and dist.is_initialized():
                dist.destroy_process_group()
    except Preempted:
        return EXIT_PREEMPTED
    except PlatformError as exc:
        rank = os.environ.get("RANK")
        # One write, newline included: ranks share torchrun's stderr, and unbuffered (print
        # writes the text and the newline apart) their lines would interleave.
        sys.stderr.write(
            f"{command_name(_PROG)}: error: {exc}" + (f" (rank {rank})" if rank is not None else "") + "\n"
        )
        sys.stderr.flush()
        return 2
    if world.rank == 0:
        print(_summary(cfg, metrics))
    return 0


def _summary(cfg: TrainConfig, metrics: dict[str, Any]) -> str:
    epochs = metrics["epochs"]
    last = epochs[-1] if epochs else {}
    shares = last.get("data_wait_share", [])
    test = metrics["test_accuracy"]
    ap = (metrics.get("test") or {}).get("mean_average_precision")
    headline = (
        f"test mean average precision {ap:.4f}"
        if ap is not None
        else (f"test accuracy {'n/a (no test channel)' if test is None else f'{test:.4f}'}")
    )
    return (
        f"{headline} | "
        f"{last.get('images_per_s', float('nan')):.0f} images/s | "
        f"data wait {' '.join(f'{s:.0%}' for s in shares) or 'n/a'} (per rank) | "
        f"metrics: {storage.join(storage.normalize(cfg.output), 'metrics.json')}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
