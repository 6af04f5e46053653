"""``ShardLoader.as_dataset()``: the loader as a :class:`torch.utils.data.IterableDataset`.

For code that expects a dataset or a ``DataLoader``: a plain ``DataLoader`` or the return value
of a PyTorch Lightning ``train_dataloader()``::

    ds = loader.as_dataset()
    dl = torch.utils.data.DataLoader(ds, batch_size=None)   # the batches are the loader's

Each item is one of the loader's batches, so a ``DataLoader`` must not batch them again
(``batch_size=None``), and runs with ``num_workers=0``: the loader has its own reader and decode
threads; a worker process would start another copy of them and yield the rank's batches again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset, get_worker_info

from lakeshard.errors import ConfigError

if TYPE_CHECKING:
    from loaders.shard_loader import ShardLoader

__all__ = ["ShardDataset"]


class ShardDataset(IterableDataset[Any]):  # yields the loader's batches
    """A view of a :class:`~loaders.ShardLoader`: iterating it iterates the loader (one epoch,
    the one :meth:`set_epoch` selected); ``len``, ``set_epoch``, ``state_dict`` and
    ``load_state_dict`` are the loader's."""

    def __init__(self, loader: ShardLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        if worker is not None:
            raise ConfigError(
                f"ShardLoader.as_dataset() was iterated in DataLoader worker {worker.id} of {worker.num_workers}: use "
                "DataLoader(dataset, batch_size=None, num_workers=0). The loader reads and decodes on its own threads "
                f"(num_threads={self.loader.options.num_threads}); every worker process would start its own copy "
                "and yield this rank's batches once more"
            )
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ShardDataset({self.loader.dataset!r}, channel={self.loader.options.channel!r}, batches={len(self)})"
