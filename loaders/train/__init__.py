"""The example trainer: a small CNN (or your model) trained with DDP on a lakeshard dataset.

    python -m loaders.train --dataset ./datasets/pets-v1 --epochs 5 --output runs/pets
    torchrun --nproc_per_node=2 -m loaders.train --dataset ./datasets/pets-v1 --conf conf/train.yaml

A user of the library needs none of this package: :class:`~loaders.ShardLoader` is the loader.
This is a trainer to try a dataset out, and the reference of how the loader is used under DDP
(checkpoints, elastic resume, preemption).

| module | what it owns |
|---|---|
| :mod:`~loaders.train.loop` | ``main`` and ``train``: the epoch loop, its validation and final test |
| :mod:`~loaders.train.steps` | an epoch's training steps: forward, backward, step checkpoints |
| :mod:`~loaders.train.checkpoint` | saving the checkpoint (rank 0, agreed by all) and resuming from it |
| :mod:`~loaders.train.records` | each epoch's record: logged, exported, in ``metrics.json`` |
| :mod:`~loaders.train.session` | what the steps share (``Run``): loaders, model under DDP, optimiser |
| :mod:`~loaders.train.world` | :class:`World`: this process's rank and device; collectives over the ranks |
| :mod:`~loaders.train.export` | each epoch's figures as Prometheus metrics and TensorBoard scalars |
| :mod:`~loaders.train.evaluation` | ``evaluate``: accuracy over a channel, top-1 and per class |
| :mod:`~loaders.train.metrics` | an epoch's training totals and its record in ``metrics.json`` |
| :mod:`~loaders.train.checks` | every check made before the process group starts |
| :mod:`~loaders.train.config` | :class:`TrainConfig`: the options (``conf/train.yaml``) |
| :mod:`~loaders.train.model` | the small CNN and ``--model package.module:factory`` |
| :mod:`~loaders.train.preemption` | SIGTERM / SIGUSR1: stop at an agreed step, checkpoint, exit 75 |
"""

from loaders.train.config import TrainConfig
from loaders.train.evaluation import evaluate
from loaders.train.loop import main, train
from loaders.train.world import World

__all__ = ["TrainConfig", "World", "evaluate", "main", "train"]
