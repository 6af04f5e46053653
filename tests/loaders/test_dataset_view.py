"""``ShardLoader.as_dataset()``: a ``torch.utils.data.IterableDataset`` driven by a plain
``DataLoader`` and by a PyTorch Lightning ``Trainer``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loader_builders import ids_of
from torch.utils.data import DataLoader, IterableDataset

from lakeshard.errors import ConfigError
from loaders import ShardLoader
from loaders.transforms import RandomFlipCrop


def _batches(iterable) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(images.clone(), labels.clone()) for images, labels in iterable]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and torch.equal(lx, ly) for (x, lx), (y, ly) in zip(a, b, strict=True)
    )


def test_a_plain_dataloader_yields_the_loaders_batches(dataset: Path):
    kwargs = dict(batch_size=6, shuffle=True, seed=3, shuffle_window=9, transform=RandomFlipCrop(6))
    direct = ShardLoader(str(dataset), **kwargs)
    direct.set_epoch(1)
    expected = _batches(direct)

    ds = ShardLoader(str(dataset), **kwargs).as_dataset()
    assert isinstance(ds, IterableDataset)
    dl = DataLoader(ds, batch_size=None)
    assert len(dl) == len(ds) == 7
    ds.set_epoch(1)
    got = _batches(dl)
    assert got[0][0].shape == (6, 3, 6, 6)
    assert _same(got, expected)
    ds.set_epoch(0)
    assert not _same(_batches(dl), expected)  # set_epoch reached the loader


def test_state_passes_through_the_dataset_view(dataset: Path):
    kwargs = dict(batch_size=4, shuffle=True, seed=8)
    expected = _batches(ShardLoader(str(dataset), **kwargs))
    ds = ShardLoader(str(dataset), **kwargs).as_dataset()
    it = iter(DataLoader(ds, batch_size=None))
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    assert state["batches_consumed"] == 3
    del it
    ds.loader.close()

    resumed = ShardLoader(str(dataset), **kwargs).as_dataset()
    resumed.load_state_dict(state)
    assert _same(_batches(DataLoader(resumed, batch_size=None)), expected[3:])


@pytest.mark.slow  # DataLoader worker processes: ~10 s to stop
def test_worker_processes_are_refused_with_the_reason(dataset: Path):
    ds = ShardLoader(str(dataset), batch_size=8).as_dataset()
    with pytest.raises(
        ConfigError,
        match=r"iterated in DataLoader worker 0 of 2: use DataLoader\(dataset, batch_size=None, "
        r"num_workers=0\)\. The loader reads and decodes on its own threads",
    ):
        next(iter(DataLoader(ds, batch_size=None, num_workers=2)))


def _reference_ids(dataset: Path, epoch: int) -> list[int]:
    reference = ShardLoader(str(dataset), batch_size=8, shuffle=True, seed=2)
    reference.set_epoch(epoch)
    return [i for images, _ in reference for i in ids_of(images)]


@pytest.mark.slow
def test_lightning_trainer_fits_two_epochs_on_the_dataset_view_and_resumes(dataset: Path, tmp_path: Path):
    import lightning  # the 'lightning' extra (scripts/setup.sh installs it)
    from torch import nn

    from loaders import PAD_LABEL

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))
            self.seen: dict[int, list[int]] = {}

        def train_dataloader(self):
            self.data = ShardLoader(str(dataset), batch_size=8, shuffle=True, seed=2).as_dataset()
            return self.data

        def on_train_epoch_start(self) -> None:
            self.data.set_epoch(self.current_epoch)

        def training_step(self, batch, batch_idx):
            images, labels = batch
            self.seen.setdefault(self.current_epoch, []).extend(ids_of(images))
            return nn.functional.cross_entropy(self.net(images.float() / 255), labels, ignore_index=PAD_LABEL)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(epochs: int, ckpt_path: str | None = None) -> tuple[Module, lightning.Trainer]:
        module = Module()
        trainer = lightning.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        module.data.loader.close()
        return module, trainer

    module, trainer = fit(2)
    assert trainer.global_step == 2 * len(module.data) == 10
    assert sorted(module.seen) == [0, 1]
    for epoch in (0, 1):
        assert sorted(module.seen[epoch]) == list(range(40))
        assert module.seen[epoch] == _reference_ids(dataset, epoch)

    # Lightning's checkpoint holds the loader's state (the dataset view has state_dict and
    # load_state_dict); a third epoch resumed from it reads epoch 2's order.
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [(s["epoch"], s["batches_consumed"]) for s in saved] == [(1, 5)]
    module, trainer = fit(3, str(ckpt))
    assert trainer.global_step == 15 and sorted(module.seen) == [2]
    assert module.seen[2] == _reference_ids(dataset, 2)
