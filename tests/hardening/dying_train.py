"""``python -m loaders.train`` whose rank ``LAKESHARD_DIE_RANK`` dies (``os._exit(9)``, no
cleanup, as a lost host) when its training loader has yielded ``LAKESHARD_DIE_AFTER`` batches.
Every other rank runs the real, unpatched training code; the test checks that they fail with
a clear error instead of hanging.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.hardening.dying_train ...
"""

from __future__ import annotations

import os
import sys

from loaders.train import loop as train
from loaders.train import session


def _arm() -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank != int(os.environ.get("LAKESHARD_DIE_RANK", "1")):
        return
    after = int(os.environ.get("LAKESHARD_DIE_AFTER", "2"))
    loader_cls = session.ShardLoader

    class DyingLoader(loader_cls):  # only the dying rank gets this class
        def __iter__(self):
            for i, batch in enumerate(super().__iter__()):
                if self.options.channel == "train" and i >= after:
                    sys.stderr.write(f"dying_train: rank {rank} dies now (os._exit) after {after} batches\n")
                    sys.stderr.flush()
                    os._exit(9)
                yield batch

    session.ShardLoader = DyingLoader


if __name__ == "__main__":
    _arm()
    sys.exit(train.main())
