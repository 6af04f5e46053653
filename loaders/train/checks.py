"""What ``python -m loaders.train`` checks before any work, on every rank and before the process
group starts, so that all ranks fail alike with one error line: the options against the world
size, the dataset, the checkpoint to resume from (the same model, optimiser and global batch),
the model (it fits the data: :func:`loaders.train.model.check_model`) and the output and
TensorBoard folders (they can be written). :func:`prepare` returns what it found as a :class:`TrainPlan`.
"""

from __future__ import annotations

import io
import os
import random
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lakeshard import format as contract
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, LoaderError, PlatformError, StorageError
from lakeshard.format.label_columns import BOXES
from loaders._internal.state import last_leg
from loaders.train.config import TrainConfig, sources
from loaders.train.model import build_model, check_model, describe, load_weights

__all__ = ["EVAL_CHANNELS", "TrainPlan", "prepare"]

#: The channels evaluated when the dataset has them: validation after each epoch, test at the end.
EVAL_CHANNELS = ("validation", "test")


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """What :func:`prepare` checked before any expensive work, for :func:`loaders.train.train` to use."""

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
    dataset_version: str  # of the dataset, or its sources' joined by "+"
    task: str | None = None  # "multi-label", or None: single-label (a boxes dataset is refused)


def prepare(cfg: TrainConfig, world_size: int) -> TrainPlan:
    """Check the options against the world size, the dataset and the checkpoint; raise a
    :class:`PlatformError` naming the bad value. Reads ``dataset.json`` and the checkpoint only:
    every rank runs it before the process group starts, and fails alike."""
    dataset = cfg.dataset
    if not dataset:
        raise ConfigError("TrainConfig.dataset is required")
    output = storage.normalize(cfg.output)
    checkpoint_uri = storage.join(output, "checkpoint.pt")
    resume_uri, checkpoint = _find_checkpoint(cfg, checkpoint_uri)
    if checkpoint is not None:
        _check_resumed_options(cfg, resume_uri, checkpoint)
        _check_resumed_batch(cfg, world_size, resume_uri, checkpoint)
        _check_source_order(cfg, resume_uri, checkpoint)
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"batch_size {cfg.batch_size} (global) is not divisible by the world size {world_size}: "
            f"each rank would get {cfg.batch_size / world_size:g} rows; pass a --batch-size that is a multiple of {world_size}"
        )
    found = _read_sources(dataset)
    labels = found.labels
    if len(labels) < 2:
        raise DatasetError(
            f"{found.where} lists {len(labels)} class(es) ({', '.join(map(str, labels)) or 'none'}): "
            "a classifier needs at least 2; build the dataset from a lake with two or more label folders"
        )
    image_size = found.image_size
    skipped = {
        c: f"the dataset has no {c!r} channel (it has: {', '.join(found.channels)})"
        for c in EVAL_CHANNELS
        if c not in found.channels
    }
    if cfg.precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"--precision bf16: this GPU ({torch.cuda.get_device_name()}) does not support bfloat16; use --precision fp32"
        )
    if checkpoint is not None and checkpoint.get("dataset_version") != found.version:
        raise DatasetError(
            f"refusing to resume from {resume_uri}: {found.changed(checkpoint.get('dataset_version'))}"
        )
    model = _build_model(cfg, len(labels), image_size, resume_uri, checkpoint)
    _check_writable("--output", cfg.output, output)  # last: they write (and remove) a file
    if cfg.tensorboard_dir is not None:
        _check_writable("--tensorboard-dir", cfg.tensorboard_dir, storage.normalize(cfg.tensorboard_dir))
    return TrainPlan(
        per_rank_batch=cfg.batch_size // world_size,
        num_classes=len(labels),
        image_size=image_size,
        class_names=tuple(sorted(labels, key=labels.__getitem__)),
        dataset_version=found.version,
        model=model,
        skipped=skipped,
        checkpoint_uri=checkpoint_uri,
        metrics_uri=storage.join(output, "metrics.json"),
        resume_uri=resume_uri,
        checkpoint=checkpoint,
        task=found.task,
    )


@dataclass(frozen=True, slots=True)
class _Sources:
    """What the trainer needs of its dataset, or of the datasets it mixes."""

    where: str  #: the dataset.json file(s) read
    labels: dict[str, int]  #: label name -> index (the union of the sources' names, sorted)
    channels: tuple[str, ...]  #: evaluation channels: those of any source
    image_size: int
    uris: tuple[str, ...]
    versions: tuple[str, ...]
    task: str | None  #: the first dataset's (a mixture of others is the loader's to refuse)

    @property
    def version(self) -> str:
        return "+".join(self.versions)

    def changed(self, saved: Any) -> str:
        """Why a checkpoint of dataset version ``saved`` is not of these datasets."""
        parts = str(saved).split("+")
        if len(self.uris) > 1 and len(parts) == len(self.versions):
            return "; ".join(
                f"it was trained on {uri} version {old!r}, which is now version {new!r}"
                for uri, old, new in zip(self.uris, parts, self.versions, strict=True)
                if old != new
            )
        what = self.uris[0] if len(self.uris) == 1 else f"the datasets {', '.join(self.uris)}"
        return f"it was trained on dataset version {saved!r}, {what} is version {self.version!r}"


def _read_sources(dataset: str | tuple[str, ...]) -> _Sources:
    """Read and check each dataset's ``dataset.json``: a train channel, label indices 0..n-1, and
    (when several) one image size."""
    names: set[str] = set()
    channels: set[str] = set()
    uris, versions, sizes, wheres, tasks = [], [], {}, [], []
    labels: dict[str, int] = {}
    for uri, _ in sources(dataset):
        info = contract.read_dataset_info(uri)
        where = contract.dataset_json_uri(storage.normalize(uri))
        if info.task == BOXES:
            raise ConfigError(
                f"{where} is a boxes dataset: the trainer trains classifiers; feed your detection model from "
                "ShardLoader (docs/loader.md, Multi-label and boxes datasets, the detection loop)"
            )
        tasks.append(info.task)
        if "train" not in info.channels:
            raise DatasetError(
                f"{where} has no 'train' channel (it has: {', '.join(info.channels) or 'none'}); nothing to train on"
            )
        labels = info.labels
        if set(labels.values()) != set(range(len(labels))):
            raise DatasetError(
                f"{where}: label indices must be 0..{len(labels) - 1}, one per label, got {list(labels.values())}"
            )
        names |= set(labels)
        channels |= set(info.channels)
        uris.append(uri)
        versions.append(info.dataset_version)
        sizes[uri] = info.image.size
        wheres.append(where)
    if len(set(sizes.values())) > 1:
        raise DatasetError(
            "the datasets have images of different sizes ("
            + ", ".join(f"{u}: {s} px" for u, s in sizes.items())
            + "); the trainer mixes datasets of one image size (MixedLoader takes crop=N)"
        )
    if len(uris) > 1:
        labels = {name: i for i, name in enumerate(sorted(names))}
    ordered = tuple(c for c in contract.CHANNELS if c in channels)
    return _Sources(
        ", ".join(wheres), labels, ordered, next(iter(sizes.values())), tuple(uris), tuple(versions), tasks[0]
    )


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
            raise ConfigError(
                f"--resume {cfg.resume}: no checkpoint at {uri} (pass --resume auto to start afresh when there is none)"
            )
    try:
        ckpt = torch.load(io.BytesIO(storage.read_bytes(uri)), map_location="cpu", weights_only=True)
    except PlatformError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"--resume: cannot load the checkpoint {uri}: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "scheduler", "loader", "metrics"} <= set(
        ckpt
    ):
        raise ConfigError(f"--resume: {uri} is not a checkpoint of loaders.train")
    return uri, ckpt


#: The options a resumed run keeps: they decide the shapes of the model's and optimiser's state.
#: What a resumed run takes from its checkpoint, not from the command line: the network, and the
#: optimizer and learning-rate schedule whose states it loads (their settings are in those states).
_KEPT_ON_RESUME = ("model", "width", "optimizer", "lr", "momentum", "weight_decay", "gamma", "step_size")


def _check_source_order(cfg: TrainConfig, uri: str | None, ckpt: dict[str, Any]) -> None:
    """A mixture resumed with its datasets in another order is another mixture (a source's rows
    are dealt by its position): refused naming the checkpoint's order, before the versions (joined
    in that order) would name both datasets as rebuilt."""
    saved = ckpt.get("config", {}).get("dataset") if isinstance(ckpt.get("config"), dict) else None
    if isinstance(cfg.dataset, str) or not isinstance(saved, list | tuple) or not cfg.dataset:
        return
    try:
        old = [storage.normalize(u) for u, _ in sources(tuple(map(str, saved)))]
        new = [storage.normalize(u) for u, _ in sources(cfg.dataset)]
    except (PlatformError, ValueError):
        return  # not URIs: the checks that follow name them
    if old != new and sorted(old) == sorted(new):
        raise ConfigError(
            f"refusing to resume from {uri}: the checkpoint mixes {', '.join(old)} in that order and this run "
            f"passes {', '.join(new)}: the same datasets in another order are another mixture (rows are dealt "
            f"by a dataset's position); pass them in the checkpoint's order: "
            + " ".join(f"--dataset {item}" for item in saved)
        )


def _option(name: str, value: Any) -> str:
    """An option as the user would type it: ``--width 4``, or ``no --model`` for its default."""
    if name == "model" and value is None:
        return "no --model"
    return f"--{name.replace('_', '-')} {value}"


def _check_resumed_options(cfg: TrainConfig, uri: str | None, ckpt: dict[str, Any]) -> None:
    """A resumed run keeps the ``--model``, ``--width`` (of the small CNN), ``--optimizer`` and
    the optimizer's and schedule's settings its checkpoint was trained with (its ``config``):
    loading the optimizer's and the schedule's states would otherwise drop a changed ``--lr``
    (or momentum, weight decay, gamma, step size) without a word."""
    saved = ckpt.get("config")
    if not isinstance(saved, dict):
        return
    for name in _KEPT_ON_RESUME:
        if name not in saved or saved[name] == getattr(cfg, name):
            continue
        if name == "width" and (cfg.model is not None or saved.get("model") is not None):
            continue  # the width of the small CNN, which neither run trains
        if name == "momentum" and cfg.optimizer == saved.get("optimizer") == "adamw":
            continue  # SGD's momentum, which AdamW ignores
        now, then = _option(name, getattr(cfg, name)), _option(name, saved[name])
        small = " (the small CNN)" if name == "model" and saved[name] is None else ""
        raise ConfigError(
            f"{now} differs from the checkpoint {uri}, trained with {then}{small}: "
            f"a resumed run keeps its model, optimizer and learning-rate schedule; pass {then} "
            "(or another --output to start a new run)"
        )


def _check_writable(flag: str, given: str, folder: str) -> None:
    """``folder`` (``--output``, ``--tensorboard-dir``) can be written: a probe file is written
    there and removed (on every rank, so that all fail alike), instead of finding out when rank 0
    saves the first checkpoint or opens the TensorBoard writer."""
    probe = storage.join(folder, f".write-probe-{uuid.uuid4().hex}")
    try:
        storage.write_bytes_atomic(probe, b"", durable=False)
        storage.remove(probe)
    except StorageError as exc:
        raise ConfigError(f"{flag} {given}: cannot write there: {_unwritable(folder, exc)}") from None


def _unwritable(output: str, exc: StorageError) -> str:
    """Why ``output`` could not be written, in the user's terms."""
    cause = exc.__cause__
    if storage.is_local(output):
        path = storage.local_path(output)
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{path} is a file, not a folder"
    elif "NoSuchBucket" in repr(cause) or "bucket does not exist" in str(exc):
        return f"the bucket {storage.bucket(output)!r} does not exist"
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)


def _check_resumed_batch(cfg: TrainConfig, world_size: int, uri: str | None, ckpt: dict[str, Any]) -> None:
    """A resumed run keeps its checkpoint's global batch, on any world size that divides it (the
    loader deals the rest of the interrupted epoch to the new ranks: :mod:`loaders._internal.elastic`)."""
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


def _build_model(
    cfg: TrainConfig,
    num_classes: int,
    image_size: int,
    resume_uri: str | None,
    checkpoint: dict[str, Any] | None,
) -> nn.Module:
    """The model: built seeded, checked against the data and, when resuming, loaded from
    ``checkpoint``."""
    _seed_everything(cfg.seed)  # the model's initial weights
    model = build_model(cfg.model, num_classes, image_size, width=cfg.width)
    check_model(model, cfg.model, num_classes, image_size, width=cfg.width, bf16=cfg.precision == "bf16")
    if checkpoint is not None:
        name = describe(cfg.model, width=cfg.width)
        load_weights(model, checkpoint["model"], source=str(resume_uri), name=name)
    return model


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
