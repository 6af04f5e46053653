"""``python -m loaders.doctor``: parse, check, measure each stage, decide, print.

``main`` is the command's shape (as ``loaders.train``'s): a bad option, dataset, channel,
transform or model is one ``python -m loaders.doctor: error: ...`` line on stderr and exit
status 2, before any measuring; each stage says on stderr what it measures as it starts.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable

from lakeshard.errors import LoaderError, PlatformError
from lakeshard.format.label_columns import MULTI_LABEL
from lakeshard.settings import command_name
from loaders.doctor.config import PROG, parse_args
from loaders.doctor.figures import Figures, ModelFigures, TransformFigures
from loaders.doctor.measure import decode_threads, measure_decode, measure_store, measure_transform
from loaders.doctor.model_step import ModelStep, measure_model, measure_together
from loaders.doctor.preflight import Plan, prepare
from loaders.doctor.render import render
from loaders.doctor.verdict import decide

__all__ = ["main", "measure"]


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def measure(plan: Plan, *, progress: Callable[[str], None] = _progress) -> Figures:
    """Run the stages of ``plan`` alone, then together; ``progress`` gets one line a stage."""
    setup, seconds = plan.setup, plan.config.seconds
    span = f"({seconds:g} s)"
    where = "remote store" if setup.remote else "local disk"
    progress(f"measuring the store read rate, {where} {span}...")
    store, sample = measure_store(setup.dataset, plan.options, seconds=seconds)
    if not sample.images:
        raise LoaderError(f"the store stage read no image of channel {setup.channel!r} of {setup.dataset}")
    ks = ", ".join(map(str, decode_threads(setup.threads)))
    progress(f"measuring decoding on {ks} thread(s), {len(sample.images)} sampled images {span}...")
    decode, batches = measure_decode(
        sample, size=setup.image_size, batch_size=setup.batch_size, threads=setup.threads, seconds=seconds
    )
    transform: TransformFigures | None = None
    if plan.transform is not None:
        progress(f"measuring the transform on one thread {span}...")
        transform = measure_transform(plan.transform, batches, seconds=seconds)
    model: ModelFigures | None = None
    step: ModelStep | None = None
    if plan.model is not None:
        step = ModelStep(plan.model)
        progress(f"measuring the model step on {step.device.type} {span}...")
        model = measure_model(
            step,
            input_shape=plan.input_shape,
            batch_size=setup.batch_size,
            num_classes=plan.num_classes,
            seconds=seconds,
            multi_hot=plan.task == MULTI_LABEL,
        )
    feeding = "feeding the model" if step is not None else "consumed by an empty loop"
    progress(f"measuring the loader with the transform on {setup.threads} thread(s), {feeding} {span}...")
    together = measure_together(
        setup.dataset, plan.options, transform=plan.transform, step=step, seconds=seconds
    )
    return Figures(setup, store, decode, together, transform, model)


def main(argv: list[str] | None = None) -> int:
    """Returns 0; 2 after one error line for an error the platform raises on purpose (a bad
    option, dataset, channel, transform or model; a loader that fails while measured)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = parse_args(argv)
        plan = prepare(config)
        figures = measure(plan)
    except PlatformError as exc:
        line = " ".join(str(exc).split())  # one line, whatever the message holds
        sys.stderr.write(f"{command_name(PROG)}: error: {line}\n")
        sys.stderr.flush()
        return 2
    verdict = decide(figures)
    if config.json:
        print(json.dumps({**verdict.to_json(), "figures": figures.to_json()}, allow_nan=False))
    else:
        print(render(figures, verdict))
    return 0
