"""``python -m loaders.train`` that records which samples every rank trains on and, when asked,
dies on every rank (``os._exit(9)``, no cleanup, as a preempted job) mid-epoch, or takes its time
over every batch (so that a test can signal it mid-epoch). The training code is the real,
unpatched one; only the loaders (one dataset's or a mixture's) are wrapped, to watch what they yield.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.hardening.recording_train ...

Environment:
    LAKESHARD_RECORD: a path prefix; rank ``r`` appends one JSON line per training batch,
        ``{"epoch", "step", "ids", "pid"}``, to ``<prefix>-rank<r>.jsonl`` (``ids``: the sample ids
        of its real rows, decoded from the images of ``tests/loaders/loader_builders.py``), and
        one per evaluation batch, ``{"ids", "pid"}``, to ``<prefix>-<channel>-rank<r>.jsonl``.
    LAKESHARD_DIE_EPOCH, LAKESHARD_DIE_AFTER: every rank dies when the training loader is asked
        for the next batch after ``DIE_AFTER`` batches of epoch ``DIE_EPOCH`` (their steps done).
    LAKESHARD_BATCH_SECONDS: every loader (training and evaluation) waits this long before it
        yields each batch, after recording it.
    LAKESHARD_SIGNAL_AFTER: an evaluation channel; the process sends itself SIGTERM when that
        channel's loader has yielded its last batch, the first time (the trainer asked for one
        more after its check of the last batch).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

from loaders.batch import PAD_LABEL
from loaders.train import loop as train
from loaders.train import session


def _ids(images: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """Ids of the real rows of a batch the trainer's loader normalised to ``(x/255 - 0.5) / 0.5``."""
    pixels = torch.round((images[:, :2, 0, 0].float() * 0.5 + 0.5) * 255).to(torch.int64)
    ids = pixels[:, 0] + 256 * pixels[:, 1]
    return [i for i, label in zip(ids.tolist(), labels.tolist(), strict=True) if label != PAD_LABEL]


def _arm() -> None:
    rank = int(os.environ.get("RANK", "0"))
    prefix = os.environ["LAKESHARD_RECORD"]
    die_epoch = int(os.environ.get("LAKESHARD_DIE_EPOCH", "-1"))
    die_after = int(os.environ.get("LAKESHARD_DIE_AFTER", "-1"))
    pause = float(os.environ.get("LAKESHARD_BATCH_SECONDS", "0"))
    signal_after = [os.environ.get("LAKESHARD_SIGNAL_AFTER")]

    def recording(loader_cls: type) -> type:
        """``loader_cls`` (ShardLoader or MixedLoader) recording what it yields."""

        class RecordingLoader(loader_cls):
            def __iter__(self):
                channel = self.options.channel
                if channel != "train":
                    with open(f"{prefix}-{channel}-rank{rank}.jsonl", "a") as out:
                        for images, labels in super().__iter__():
                            out.write(json.dumps({"ids": _ids(images, labels), "pid": os.getpid()}) + "\n")
                            out.flush()
                            time.sleep(pause)
                            yield images, labels
                    if signal_after[0] == channel:
                        signal_after[0] = None
                        sys.stderr.write(
                            f"recording_train: rank {rank} sends itself SIGTERM after its {channel} batches\n"
                        )
                        sys.stderr.flush()
                        os.kill(os.getpid(), signal.SIGTERM)
                    return
                step = self.state_dict()["batches_consumed"]
                with open(f"{prefix}-rank{rank}.jsonl", "a") as out:
                    for images, labels in super().__iter__():
                        record = {
                            "epoch": self.epoch,
                            "step": step,
                            "ids": _ids(images, labels),
                            "pid": os.getpid(),
                        }
                        out.write(json.dumps(record) + "\n")
                        out.flush()
                        time.sleep(pause)
                        yield images, labels
                        step += 1
                        if self.epoch == die_epoch and step == die_after:
                            sys.stderr.write(
                                f"recording_train: rank {rank} dies now (os._exit) at epoch {die_epoch}, step {step}\n"
                            )
                            sys.stderr.flush()
                            os._exit(9)

        return RecordingLoader

    session.ShardLoader = recording(session.ShardLoader)
    session.MixedLoader = recording(session.MixedLoader)


if __name__ == "__main__":
    _arm()
    sys.exit(train.main())
