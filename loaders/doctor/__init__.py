"""Find what bounds feeding a model on this machine: the store, decoding, the transform or the
model (the AWS white paper's steps), and what to do next.

```
python -m loaders.doctor --dataset s3://lake/datasets/pets-v1 --model mynets.resnet:build --crop 224 --augment
python -m loaders.doctor --dataset /data/pets-v1 --transform mynets.aug:crop_and_jitter --threads 8 --json
```

Options: ``--dataset URI`` (required), ``--channel train``, ``--model pkg.module:factory``,
``--batch-size 64``, ``--transform pkg.module:name`` (a callable ``fn(images, labels,
generator)``; or the loader's own ``--augment``/``--crop N``), ``--threads N`` (default: the
cores this process may use), ``--seconds S`` (each stage; default 5), ``--rank R --world-size
W`` (whose rows are read), ``--json``; and the loader's own ``--read-concurrency``,
``--memory-budget``, ``--cache-dir``, ``--cache-limit``, ``--prefetch``, ``--shuffle-window``
(made from :data:`loaders.options.OPTIONS`, with the library's defaults; ``NOT_FLAGS`` in
:mod:`loaders.doctor.config` says why the others are not flags).

Each stage is measured alone, for ``--seconds``, then all of them together:

1. **store**: a fresh ``ShardLoader(decoder="none")``, the pure read path: rows/s and bytes/s;
2. **decode**: up to 2,000 of those encoded images decoded with the loader's decoder on 1, 2, 4,
   ... ``--threads`` threads: images/s and per-thread efficiency;
3. **transform** (with ``--transform``, ``--augment`` or ``--crop``): CPU seconds per image on
   one thread, on what the loader gives it (a multi-label or boxes dataset: the images and
   their :class:`~loaders.Batch`);
4. **model** (with ``--model``; refused on a boxes dataset, as by the trainer): SGD steps on
   random batches, on CUDA when there is one;
5. **together**: a ``ShardLoader`` with the transform on ``--threads`` threads feeding the model
   step (or an empty loop): images/s and the share of time spent waiting for data.

The verdict (:func:`decide`, a pure function of the figures: :mod:`loaders.doctor.verdict`)
names the slowest stage, by how much the next one is faster, and the next steps for that
stage. A bad option, dataset, channel, transform or model is one
``python -m loaders.doctor: error: ...`` line and exit status 2, before any measuring.
"""

from loaders.doctor.command import main, measure
from loaders.doctor.config import DoctorConfig
from loaders.doctor.figures import (
    DecodeFigures,
    DecodeRun,
    Figures,
    ModelFigures,
    Setup,
    StoreFigures,
    TogetherFigures,
    TransformFigures,
)
from loaders.doctor.next_steps import Step
from loaders.doctor.rates import cpu_rate
from loaders.doctor.verdict import STAGES, Verdict, decide

__all__ = [
    "STAGES",
    "DecodeFigures",
    "DecodeRun",
    "DoctorConfig",
    "Figures",
    "ModelFigures",
    "Setup",
    "Step",
    "StoreFigures",
    "TogetherFigures",
    "TransformFigures",
    "Verdict",
    "cpu_rate",
    "decide",
    "main",
    "measure",
]
