"""An epoch's record (:class:`~loaders.train.metrics.EpochRecord`): built from its training
and validation, kept in the run's history, logged as the line the epoch ends with and exported;
and ``metrics.json``, which rank 0 writes after each epoch and at the end."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from lakeshard import storage
from loaders.mixed_loader import MixedLoader
from loaders.shard_loader import ShardLoader
from loaders.stats import usd
from loaders.train.average_precision import AveragePrecision
from loaders.train.evaluation import Accuracy
from loaders.train.export import EpochFigures
from loaders.train.metrics import EpochRecord, LoaderSummary, find_straggler
from loaders.train.session import Run
from loaders.train.steps import Trained
from loaders.train.world import all_reduce, info_level

__all__ = ["record_epoch", "write_metrics"]

log = logging.getLogger(__name__)


def _source_rows(run: Run, loader: ShardLoader | MixedLoader) -> list[dict[str, Any]] | None:
    """A mixture's sources: each one's weight, its planned rows an epoch and the rows this run
    took from it (all ranks); ``None`` for one dataset."""
    if not isinstance(loader, MixedLoader):
        return None
    took = all_reduce([float(n) for n in loader.source_rows], run.world)
    return [
        {"dataset": uri, "weight": w, "planned_rows": planned, "rows": int(n)}
        for uri, w, planned, n in zip(loader.sources, loader.weights, loader.per_source, took, strict=True)
    ]


def record_epoch(
    run: Run, epoch: int, trained: Trained, validation: Accuracy | AveragePrecision | None
) -> EpochRecord:
    """Epoch ``epoch``'s record, appended to the run's epochs and logged as the line it ends with."""
    loader = run.loaders.train
    summary = _loader_summary(trained)
    record = EpochRecord(
        epoch=epoch,
        loss=trained.totals.loss,
        validation=validation,
        images_per_s=trained.images_this_run / trained.seconds if trained.seconds > 0 else 0.0,
        data_wait_share=trained.data_wait_share,
        steps=trained.steps - trained.first_step,
        resumed_at_step=trained.first_step,
        samples=trained.totals.samples,
        images=trained.totals.images,
        legs=loader.state_dict()["legs"],
        lr=float(run.scheduler.get_last_lr()[0]),  # a float, or a one-element tensor for a tensor lr
        seconds=trained.seconds,
        skipped_rows=len(loader.skipped_rows),
        sources=_source_rows(run, loader),
        loader=summary,
    )
    run.history.append(record.to_json())
    log.log(
        info_level(run.world),
        "epoch %d: loss %s, validation accuracy %s, %.0f images/s, data wait %s, %d requests, %.1f MB read, %s",
        epoch,
        "n/a" if record.loss is None else f"{record.loss:.4f}",
        "n/a" if record.val_accuracy is None else f"{record.val_accuracy:.4f}",
        record.images_per_s,
        [f"{s:.0%}" for s in record.data_wait_share],
        summary.total("requests"),
        summary.total("bytes_read") / 1e6,
        usd(summary.total("cost_usd")),
    )
    if summary.straggler_line is not None and run.world.rank == 0:
        log.warning("epoch %d: straggler: %s", epoch, summary.straggler_line)
    if run.exporter is not None:
        run.exporter.epoch(_figures(record, summary))
    return record


def _figures(record: EpochRecord, summary: LoaderSummary) -> EpochFigures:
    """An epoch's record (its training loader's statistics: ``summary``) as the exporter takes it."""
    ranks = summary.per_rank
    shuffle = ranks[0].get("shuffle") or {}
    return EpochFigures(
        epoch=record.epoch,
        images_per_s=record.images_per_s,
        loss=record.loss,
        val_accuracy=record.val_accuracy,
        data_wait_share=record.data_wait_share,
        requests=[r["requests"] for r in ranks],
        bytes_read=[r["bytes_read"] for r in ranks],
        cache_bytes=[r["cache_bytes"] for r in ranks],
        retries=[r["retries"] for r in ranks],
        cost_usd=summary.total("cost_usd"),
        read_ms_mean=[r["read_ms_mean"] for r in ranks],
        shuffle_rank_correlation=shuffle.get("rank_correlation"),
        same_group_share=shuffle.get("same_group_share"),
        straggler=summary.straggler,
    )


def _loader_summary(trained: Trained) -> LoaderSummary:
    read_ms = [r["read_ms_mean"] for r in trained.loader]
    found = find_straggler(trained.data_wait_share, read_ms)
    rank, line = found if found is not None else (None, None)
    return LoaderSummary(trained.loader, rank, line)


def write_metrics(run: Run, **final: Any) -> dict[str, Any]:
    """``metrics.json`` (rank 0 writes it): the run, its epochs so far and, at the end, the test
    (``final``)."""
    cfg = run.cfg
    metrics = {
        "dataset": cfg.dataset,
        "dataset_version": run.plan.dataset_version,
        "world_size": run.world.world_size,
        "global_batch_size": cfg.batch_size,
        "config": asdict(cfg),
        "skipped": run.plan.skipped,
        "epochs": run.history,
        **final,
    }
    if run.world.rank == 0:
        storage.write_json_atomic(run.plan.metrics_uri, metrics)
    return metrics
