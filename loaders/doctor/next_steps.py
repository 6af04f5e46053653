"""The next steps for the stage that bounds training, with the figures behind each: a table,
one function a stage (:data:`STEPS`), in the order of the AWS white paper's advice: resize
before training, add threads, cache, and a data-preparation cluster in extreme cases."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from loaders.doctor.figures import Figures
from loaders.doctor.rates import best_run, num

__all__ = ["LATENCY_BOUND_MS", "PIXELS_OVER", "SCALES", "STEPS", "Step", "split_cores"]

#: Per-thread efficiency (images/s at k threads over k times one thread's) from which more
#: threads or cores still pay.
SCALES = 0.75
#: Stored pixels over the model's input pixels from which smaller stored images pay.
PIXELS_OVER = 1.5
#: Mean store read time (ms) from which reads look latency-bound.
LATENCY_BOUND_MS = 50.0


@dataclass(frozen=True, slots=True)
class Step:
    """One next step: ``action`` is a stable key (``"cache_dir"``, ``"read_concurrency"``,
    ``"faster_disk"``, ``"epoch_start"``, ``"more_threads"``, ``"more_cores"``, ``"extension"``,
    ``"smaller_images"``, ``"gpu_decode"``, ``"prep_cluster"``, ``"lighter_transform"``,
    ``"model"``, ``"split_cores"``); ``text`` says it with the figures behind it."""

    action: str
    text: str


def _ms(seconds: float) -> str:
    return f"{num(1000 * seconds)} ms"


#: A store stage that went through this many epochs timed their starts as much as their reads.
MANY_EPOCHS = 3


def _epoch_start_step(figures: Figures) -> Step:
    """The store stage restarted epoch after epoch: its rate is the loader's start per epoch (a
    small channel, or a small share of it per rank), not the disk's."""
    setup, store = figures.setup, figures.store
    per_epoch = store.rows / store.epochs
    share = (
        f"this rank's share ({setup.rank} of {setup.world_size})" if setup.world_size > 1 else "the channel"
    )
    return Step(
        "epoch_start",
        f"{share} is {num(per_epoch)} row{'s' if per_epoch != 1 else ''} an epoch: the store stage ran {store.epochs} epochs in "
        f"{store.seconds:.1f} s, so its rate is mostly each epoch's start, not the disk; a disk upgrade "
        "would not help. Such a dataset is read from memory after the first epoch; measure a larger one "
        "(or fewer ranks) for the disk",
    )


def _store_steps(figures: Figures, rates: dict[str, float], ratio: float, nxt: str) -> list[Step]:
    setup, store = figures.setup, figures.store
    steps = []
    if store.epochs >= MANY_EPOCHS and (not setup.remote or store.cached):
        return [_epoch_start_step(figures)]
    if not setup.remote:
        return [
            Step(
                "faster_disk",
                f"the local disk gave {num(store.bytes_per_s / 1e6)} MB/s ({num(store.rows_per_s)} rows/s): put the "
                "shards on a faster local disk (NVMe), or spread them over several",
            )
        ]
    if setup.cache_dir is None:
        steps.append(
            Step(
                "cache_dir",
                "set cache_dir (--cache-dir) to a local disk with room for this rank's shards: the first epoch "
                "fills it from its own reads, and every later epoch reads local disk, not the store",
            )
        )
    elif store.cache_misses > 0:
        steps.append(
            Step(
                "cache_dir",
                f"the cache was being filled while this ran ({store.cache_misses} of "
                f"{store.cache_hits + store.cache_misses} row groups came from the store): later epochs read "
                "it from local disk; run the doctor again to measure that rate",
            )
        )
    else:
        steps.append(
            Step(
                "faster_disk",
                f"every row group came from the cache, at {num(store.bytes_per_s / 1e6)} MB/s: the cache's disk "
                "is the limit; put cache_dir on a faster local disk (NVMe)",
            )
        )
    if not store.cached and store.reads:
        per_connection = store.bytes_per_read / (store.read_ms_mean / 1000) if store.read_ms_mean else 0.0
        text = (
            f"raise read_concurrency (now {setup.read_concurrency}; try {2 * setup.read_concurrency}): reads "
            f"averaged {num(store.read_ms_mean)} ms for {num(store.bytes_per_read / 1e3)} kB each "
            f"({num(per_connection / 1e6)} MB/s per connection)"
        )
        if store.read_ms_mean >= LATENCY_BOUND_MS:
            text += ": they look latency-bound, and more reads in flight hide the wait"
        else:
            text += ": rows/s grow with the reads in flight until the link or the store is full"
        steps.append(Step("read_concurrency", text))
    return steps


def _decode_steps(figures: Figures, rates: dict[str, float], ratio: float, nxt: str) -> list[Step]:
    setup, decode = figures.setup, figures.decode
    steps = []
    last = decode.runs[-1]
    measured = len(decode.runs) > 1  # the scaling is known
    scales = not measured or decode.efficiency(last) >= SCALES
    if scales and setup.threads < setup.cores:
        steps.append(
            Step(
                "more_threads",
                f"decode on all {setup.cores} cores this process may use (num_threads={setup.cores}; "
                f"measured with {setup.threads})",
            )
        )
    elif scales and measured:
        steps.append(
            Step(
                "more_cores",
                f"decoding still scales ({decode.efficiency(last):.0%} per-thread efficiency at {last.threads} "
                f"threads) and has every core here: a node with more cores decodes about proportionally more",
            )
        )
    if not scales and not setup.batch_decoder:
        steps.append(
            Step(
                "extension",
                f"decoding scales poorly ({decode.efficiency(last):.0%} per-thread efficiency at {last.threads} "
                "threads) and the loaders._jpeg extension is not built: pip install -e . builds it (it decodes "
                "a batch with one release of the GIL)",
            )
        )
    steps += _smaller_images(figures)
    if setup.gpu is not None:
        steps.append(
            Step(
                "gpu_decode",
                f'decode on the GPU ({setup.gpu}): decoder="none" and torchvision.io.decode_jpeg(batch.images, '
                'device="cuda") (docs/loader.md, GPU decoding): the loader\'s threads then only read',
            )
        )
    if setup.threads >= setup.cores:
        steps.append(_prep_step(figures))
    return steps


def _smaller_images(figures: Figures) -> list[Step]:
    s, n = figures.setup.image_size, figures.setup.input_size
    if s * s < PIXELS_OVER * n * n:
        return []
    return [
        Step(
            "smaller_images",
            f"the images are stored at {s} px and the model takes {n} px: decoding costs about the pixels, so "
            f"shards made with the shard job's --image-size near {n} (a little above it for random crops) decode "
            f"up to {(s / n) ** 2:.1f}x faster",
        )
    ]


def _prep_step(figures: Figures) -> Step:
    return Step(
        "prep_cluster",
        f"this node has no more cores for it ({figures.setup.cores}): a preparation cluster decodes and "
        'transforms on other machines: prep="tcp://<Dask scheduler>:8786" (docs/loader.md, "A preparation cluster")',
    )


def _transform_steps(figures: Figures, rates: dict[str, float], ratio: float, nxt: str) -> list[Step]:
    setup = figures.setup
    d = best_run(figures).cpu_s_per_image
    t = figures.transform.cpu_s_per_image if figures.transform else 0.0
    w = figures.transform.wall_s_per_image if figures.transform else 0.0
    if w > max(t, d):  # it waits (I/O, a GPU sync, a sleep) more than it computes
        text = (
            f"the transform holds a thread {_ms(w)} per image but computes for {_ms(t)}: it waits (I/O, a GPU "
            f"sync, a sleep), {w / d if d else math.inf:.1f}x decoding's {_ms(d)}; stop it waiting (load what it "
            "reads once, no synchronising GPU calls), or give it more threads than cores"
        )
    else:
        text = (
            f"the transform costs {_ms(t)} of CPU per image, {t / d if d else math.inf:.1f}x decoding's "
            f"{_ms(d)}: make it lighter (torch ops on the whole batch rather than Python per image; crop "
            "before costly ops), or run it on the GPU once the batch is there"
        )
    steps = [Step("lighter_transform", text)]
    if setup.threads < setup.cores:
        steps.append(
            Step(
                "more_threads",
                f"run it on all {setup.cores} cores this process may use (num_threads={setup.cores}; "
                f"measured with {setup.threads})",
            )
        )
    else:
        steps.append(_prep_step(figures))
    return steps


def _model_steps(figures: Figures, rates: dict[str, float], ratio: float, nxt: str) -> list[Step]:
    return [
        Step(
            "model",
            f"the data keeps up; the model is the limit: the input could come at {num(rates[nxt])} images/s, "
            f"{ratio:.1f}x what the model takes ({num(rates['model'])} images/s)",
        )
    ]


#: The steps of each bottleneck: ``fn(figures, rates, ratio, next_stage)``.
STEPS: dict[str, Callable[[Figures, dict[str, float], float, str], list[Step]]] = {
    "store": _store_steps,
    "decode": _decode_steps,
    "transform": _transform_steps,
    "model": _model_steps,
}


def split_cores(figures: Figures, share: float) -> Step:
    """On the CPU, the model and the decode threads took turns on the same cores."""
    setup = figures.setup
    return Step(
        "split_cores",
        f"together ran at {share:.0%} of the slowest stage alone: on the CPU the model's intra-op threads "
        f"(torch.get_num_threads()) and the {setup.threads} decode threads take turns on the same "
        f"{setup.cores} cores; give each its own (torch.set_num_threads(a) and num_threads=b, a + b = {setup.cores})",
    )
