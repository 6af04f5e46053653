"""What the doctor measured: one small frozen dataclass per stage, and :class:`Setup`, the facts
about this machine and this run that the verdict weighs them with.

Every figure is a count and the seconds it took (rates are properties), so the JSON report
holds what was measured, not only what was concluded from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DecodeFigures",
    "DecodeRun",
    "Figures",
    "ModelFigures",
    "Setup",
    "StoreFigures",
    "TogetherFigures",
    "TransformFigures",
]


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def _steady(count: int, first: int, batches: int, seconds: float, first_s: float) -> float:
    """``count`` per second from the first batch (``first`` of them, after ``first_s``) on: what
    a long epoch runs at; over the whole ``seconds`` when only one batch came."""
    if batches > 1 and seconds > first_s:
        return _rate(count - first, seconds - first_s)
    return _rate(count, seconds)


@dataclass(frozen=True, slots=True)
class Setup:
    """This run and this machine.

    Attributes:
        threads: the decode threads measured (``--threads``), the cores decoding may use.
        cores: the CPUs this process may use (its affinity mask).
        gpu: the CUDA device's name; ``None`` without one.
        image_size: the stored images' side (``dataset.json``).
        input_size: the side the model sees: ``--crop``, else the transform's output, else
            ``image_size``.
        remote: the dataset is on a store (``s3://``), not a local disk.
        batch_decoder: the ``loaders._jpeg`` extension is built (a batch's JPEGs in one call).
        transform: how the transform was named (``--transform``, or ``--augment``/``--crop``);
            ``None``: none.
        model: ``--model``; ``None``: the model was not measured.
    """

    dataset: str
    channel: str
    rank: int
    world_size: int
    batch_size: int
    threads: int
    cores: int
    gpu: str | None
    image_size: int
    input_size: int
    remote: bool
    cache_dir: str | None
    read_concurrency: int
    batch_decoder: bool
    transform: str | None
    model: str | None


@dataclass(frozen=True, slots=True)
class StoreFigures:
    """Stage 1: a fresh ``ShardLoader(decoder="none")`` iterated alone.

    ``bytes`` are the store's body bytes plus the bytes read from the shard cache (remote), or
    the encoded bytes of the rows yielded (local); ``cache_*``: row groups read from the local shard cache (``--cache-dir``) and
    from the store instead; ``open_s``: making the loader (a remote dataset's footers);
    ``first_batch_s``: from the first ``next()`` to the first batch (``first_rows`` rows, within
    ``seconds``). The rates count from the first batch on, as the together stage's do (the
    loader's start is ``first_batch_s``, apart); bytes/s is the row rate times the bytes a row."""

    rows: int
    batches: int
    seconds: float
    bytes: int
    open_s: float
    first_batch_s: float
    first_rows: int
    epochs: int
    requests: int = 0
    reads: int = 0
    read_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0

    @property
    def rows_per_s(self) -> float:
        return _steady(self.rows, self.first_rows, self.batches, self.seconds, self.first_batch_s)

    @property
    def bytes_per_s(self) -> float:
        return self.rows_per_s * _rate(self.bytes, self.rows)

    @property
    def read_ms_mean(self) -> float:
        return 1000 * _rate(self.read_s, self.reads)

    @property
    def bytes_per_read(self) -> float:
        return _rate(self.bytes, self.reads)

    @property
    def cached(self) -> bool:
        """Every row group came from the local cache (none from the store)."""
        return self.cache_hits > 0 and self.cache_misses == 0


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """``images`` decoded by ``threads`` threads in ``seconds``; ``cpu_s``: their own CPU
    seconds (``time.thread_time``), summed."""

    threads: int
    images: int
    seconds: float
    cpu_s: float

    @property
    def images_per_s(self) -> float:
        return _rate(self.images, self.seconds)

    @property
    def cpu_s_per_image(self) -> float:
        return _rate(self.cpu_s, self.images)

    @property
    def busy_cores(self) -> float:
        """The cores the threads kept busy: CPU seconds per wall second."""
        return _rate(self.cpu_s, self.seconds)


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    """Stage 2: ``sample`` encoded images of stage 1 (``sample_bytes`` in all) decoded with the
    loader's decoder on k = 1, 2, 4, ... threads; ``runs`` in that order."""

    sample: int
    sample_bytes: int
    runs: tuple[DecodeRun, ...]

    @property
    def cpu_s_per_image(self) -> float:
        """CPU seconds per image on one thread (the least contended run)."""
        return self.runs[0].cpu_s_per_image

    def efficiency(self, run: DecodeRun) -> float:
        """``run``'s images/s over ``run.threads`` times the one-thread run's: 1.0 scales perfectly."""
        return _rate(run.images_per_s, run.threads * self.runs[0].images_per_s)

    @property
    def best(self) -> DecodeRun:
        return max(self.runs, key=lambda r: r.images_per_s)


@dataclass(frozen=True, slots=True)
class TransformFigures:
    """Stage 3: the transform on decoded batches, one thread (torch's intra-op threads set to
    one). ``thread_cpu_s``: the calling thread's CPU seconds during the calls
    (``time.thread_time``); ``cpu_s``: the process's (any thread the transform started beyond
    torch's); ``output``: what it returned, described."""

    images: int
    seconds: float
    cpu_s: float
    thread_cpu_s: float
    output: str

    @property
    def cpu_s_per_image(self) -> float:
        """What the cores pay per image: the larger of the two CPU figures."""
        return _rate(max(self.cpu_s, self.thread_cpu_s), self.images)

    @property
    def wall_s_per_image(self) -> float:
        """What a decode thread waits per image: wall time on one thread, waits (I/O, a GPU
        sync, a sleep) included."""
        return _rate(self.seconds, self.images)


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """Stage 4: ``steps`` SGD steps (forward, cross-entropy, backward, step) on random batches
    of ``input_shape``, after ``warmup_steps`` untimed ones."""

    device: str
    input_shape: tuple[int, ...]
    steps: int
    images: int
    seconds: float
    warmup_steps: int

    @property
    def images_per_s(self) -> float:
        return _rate(self.images, self.seconds)


@dataclass(frozen=True, slots=True)
class TogetherFigures:
    """Stage 5: a ``ShardLoader`` with the transform on ``--threads`` threads feeding the model
    step (or a loop that only takes the batches): ``images`` in ``batches`` over ``seconds``,
    ``wait_s`` of them spent in ``next()``; the first batch (``first_images``) came after
    ``first_batch_s``, all of it waiting.

    The rates count from the first batch on (the loader's start is ``first_batch_s``, apart), or
    over the whole time when only one batch came."""

    images: int
    batches: int
    seconds: float
    wait_s: float
    first_batch_s: float
    first_images: int
    with_model: bool

    @property
    def images_per_s(self) -> float:
        return _steady(self.images, self.first_images, self.batches, self.seconds, self.first_batch_s)

    @property
    def wait_share(self) -> float:
        if self.batches > 1 and self.seconds > self.first_batch_s:
            return _rate(self.wait_s - self.first_batch_s, self.seconds - self.first_batch_s)
        return _rate(self.wait_s, self.seconds)


@dataclass(frozen=True, slots=True)
class Figures:
    """Everything measured; ``transform`` and ``model`` are ``None`` when not measured."""

    setup: Setup
    store: StoreFigures
    decode: DecodeFigures
    together: TogetherFigures
    transform: TransformFigures | None = None
    model: ModelFigures | None = None

    def to_json(self) -> dict[str, Any]:
        """Every field, and every rate beside the counts it comes from."""
        out: dict[str, Any] = {"setup": dataclasses.asdict(self.setup)}
        store = self.store
        out["store"] = {
            **dataclasses.asdict(store),
            "rows_per_s": store.rows_per_s,
            "bytes_per_s": store.bytes_per_s,
            "read_ms_mean": store.read_ms_mean,
            "cached": store.cached,
        }
        out["decode"] = {
            "sample": self.decode.sample,
            "sample_bytes": self.decode.sample_bytes,
            "cpu_s_per_image": self.decode.cpu_s_per_image,
            "runs": [
                {
                    **dataclasses.asdict(run),
                    "images_per_s": run.images_per_s,
                    "cpu_s_per_image": run.cpu_s_per_image,
                    "efficiency": self.decode.efficiency(run),
                }
                for run in self.decode.runs
            ],
        }
        t = self.transform
        out["transform"] = (
            None
            if t is None
            else {
                **dataclasses.asdict(t),
                "cpu_s_per_image": t.cpu_s_per_image,
                "wall_s_per_image": t.wall_s_per_image,
            }
        )
        m = self.model
        out["model"] = None if m is None else {**dataclasses.asdict(m), "images_per_s": m.images_per_s}
        g = self.together
        out["together"] = {
            **dataclasses.asdict(g),
            "images_per_s": g.images_per_s,
            "wait_share": g.wait_share,
        }
        return out
