"""``ShardLoader``: stream one rank's share of a channel's Parquet shards as torch batches.

```python
loader = ShardLoader("s3://lake/datasets/pets-v1", channel="train", rank=rank, world_size=world,
                     batch_size=64, shuffle=True, seed=7)
for epoch in range(epochs):
    loader.set_epoch(epoch)
    for images, labels in loader:   # uint8 [B, 3, H, W] and int64 [B]
        ...
```

Which rows a rank reads and how many batches it yields: :mod:`loaders.plan`. The order within
an epoch: :mod:`loaders.shuffle`. The threads: :mod:`loaders.pipeline`.

State (``state_dict()``), the same on every rank, so rank 0's copy resumes them all::

    {"format": "lakeshard.ShardLoader/1", "dataset_version": "<hex>", "channel": "train",
     "epoch": 3, "batches_consumed": 17,
     "order": {"world_size": 2, "batch_size": 64, "shuffle": true, "seed": 7, "drop_last": false,
               "remainder": "pad", "shuffle_window": 2048, "rows_per_rank": 5000}}

``load_state_dict`` refuses a state saved on another dataset version or with different
``order`` settings (they would give other batches); ``num_threads``, ``prefetch`` and the rank
may differ.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from lakeshard import format as contract
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, LoaderError
from loaders.batch import NULL_LABEL, BatchTask, DecodeSpec, SkippedRow, decode_batch
from loaders.buffers import BufferPool
from loaders.decode import get_batch_decoder, get_decoder
from loaders.extensions import extension, fall_back
from loaders.pipeline import Pipeline, PipelineStats
from loaders.plan import REMAINDER_POLICIES, Piece, num_batches, rank_segments, rows_per_rank, split_pieces
from loaders.shuffle import EpochOrder, epoch_order

__all__ = ["STATE_FORMAT", "LoaderOptions", "ShardLoader", "default_threads"]

log = logging.getLogger(__name__)

_rows = extension("_rows", "images are copied out of Arrow with to_pylist(), which holds the GIL (slower)")

STATE_FORMAT = "lakeshard.ShardLoader/1"
_COLUMNS = ["image", "label", "is_pad"]
_LOCAL = pafs.LocalFileSystem()


def default_threads(local_world_size: int | None = None) -> int:
    """Decode threads when none are given: the CPUs this process may run on (its affinity mask,
    which container limits and ``taskset`` narrow), shared among the ranks on this machine
    (``local_world_size``, by default ``LOCAL_WORLD_SIZE``, which ``torchrun`` sets); at least 1.
    The trainer gives torch's intra-op threads the same share."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    if local_world_size is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
        try:
            local_world_size = int(raw)
        except ValueError:
            local_world_size = 0
        if local_world_size < 1:
            raise ConfigError(f"LOCAL_WORLD_SIZE must be a positive integer, got {raw!r} (from the environment)")
    return max(1, cpus // max(1, local_world_size))


@dataclass(frozen=True, slots=True)
class LoaderOptions:
    """Every option of :class:`ShardLoader` (see its docstring)."""

    channel: str = "train"
    rank: int = 0
    world_size: int = 1
    batch_size: int = 64
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    remainder: str = "pad"
    shuffle_window: int = 2048
    num_threads: int | None = None  # None: default_threads()
    prefetch: int = 4
    decoder: str = "auto"
    augment: bool = False
    crop: int | None = None
    normalize: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    pin_memory: bool = False
    skip_bad_rows: bool = False

    def __post_init__(self) -> None:
        if self.num_threads is None:
            object.__setattr__(self, "num_threads", default_threads())
        for name in ("batch_size", "world_size", "shuffle_window", "num_threads", "prefetch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, world_size={self.world_size}), got {self.rank!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.remainder not in REMAINDER_POLICIES:
            raise ConfigError(f"remainder must be one of {REMAINDER_POLICIES}, got {self.remainder!r}")
        if self.channel not in contract.CHANNELS:
            raise ConfigError(f"channel must be one of {contract.CHANNELS}, got {self.channel!r}")
        try:
            get_decoder(self.decoder)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.crop is not None and (not isinstance(self.crop, int) or self.crop < 1):
            raise ConfigError(f"crop must be a positive integer or None, got {self.crop!r}")
        if self.normalize is not None and (len(self.normalize) != 2 or any(len(v) != 3 for v in self.normalize)):
            raise ConfigError(f"normalize must be ((mean_r, mean_g, mean_b), (std_r, std_g, std_b)), got {self.normalize!r}")

    def order_key(self) -> dict[str, Any]:
        """The options that decide which batches come out (and so must match on resume)."""
        return {k: getattr(self, k) for k in ("world_size", "batch_size", "shuffle", "seed", "drop_last", "remainder", "shuffle_window")}


def _open_parquet(uri: str) -> tuple[Any, pq.ParquetFile]:
    """Open a shard: a local one with Arrow's own file, read on the calling thread (in C++
    without the GIL, and without a hand-off to Arrow's I/O threads: a window of 2,000 224px
    images read in 10 ms instead of 19 ms through fsspec's Python file); the rest through
    fsspec, with Arrow's pre-buffering (coalesced range requests)."""
    local = uri.startswith("file://")
    fs, path = storage.filesystem(uri)
    f = _LOCAL.open_input_file(path) if local else fs.open(path, "rb")
    try:
        return f, pq.ParquetFile(f, pre_buffer=not local)
    except BaseException:
        f.close()
        raise


# Arrow's ``to_numpy`` and ``fill_null`` import pandas on first use (0.4 s), and ``cast``
# imports ``pyarrow.compute`` (~0.1 s): on the reader thread, before a fresh process's first
# batch, with the decode threads idle. The columns the loader reads are converted from their
# buffers instead (a cast only for types the contract does not use).
def _bits(buffer: pa.Buffer, array: pa.Array) -> np.ndarray:
    """``array``'s bits (0 or 1, uint8) of a bit-packed ``buffer``: its validity or boolean values."""
    bits = np.unpackbits(np.frombuffer(buffer, dtype=np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)]


def _validity(array: pa.Array) -> np.ndarray:
    """True where ``array`` is not null."""
    bitmap = array.buffers()[0]
    return np.ones(len(array), dtype=bool) if bitmap is None else _bits(bitmap, array).astype(bool)


def _int64s(column: pa.ChunkedArray, *, null: int) -> np.ndarray:
    """An integer or boolean column as int64, ``null`` where it is null (without nulls, a
    read-only view of Arrow's buffer: the window's concatenation copies it)."""
    array = column.combine_chunks()
    if pa.types.is_boolean(array.type):
        values = _bits(array.buffers()[1], array).astype(np.int64)
    else:
        if array.type != pa.int64():
            array = array.cast(pa.int64())
        values = np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array), offset=array.offset * 8)
    return np.where(_validity(array), values, null) if array.null_count else values


def _binary_rows(column: pa.ChunkedArray) -> list[bytes | None]:
    """``column.to_pylist()`` for the image column. ``to_pylist`` holds the GIL while it copies
    a window's images (27 MB for 2,000 224px JPEGs): 9.5 us an image of the 41 us the loader's
    threads hold it, against 17 us in all for the bare decode ceiling (``benchmarks/loader_gil.py``),
    and the decode threads wait for it after every image. ``loaders/_rows.c`` allocates the
    ``bytes`` with the GIL and copies into them without it."""
    if _rows is None:
        fall_back("_rows")
        return column.to_pylist()
    rows: list[bytes | None] = []
    for chunk in column.chunks:
        validity, offsets, values = chunk.buffers() if pa.types.is_binary(chunk.type) else (None, None, None)
        if offsets is None or values is None:  # large_binary (not the contract's type), or no data
            rows.extend(chunk.to_pylist())
        else:
            rows.extend(_rows.rows(offsets, values, chunk.offset, len(chunk), validity))
    return rows


@dataclass(frozen=True, slots=True)
class _Ahead:
    """The first window of ``epoch``, read before that epoch started (see ``_tasks``)."""

    epoch: int
    cols: list[Any]


class ShardLoader:
    """Stream rank ``rank``'s share of channel ``channel`` of the dataset at ``dataset`` (a
    local path, ``file://`` or ``s3://`` URI) as ``(images, labels)`` batches.

    Args:
        dataset: the dataset root (the folder holding ``dataset.json``).
        channel: ``train``, ``validation`` or ``test``.
        rank, world_size: this process's place in the data-parallel group.
        batch_size: rows per batch on this rank (the per-rank batch, not the global one).
        shuffle: permute row groups and rows (within a window of ``shuffle_window`` rows), seeded
            by ``(seed, epoch, rank)``; off, rows come in shard order.
        seed: the seed of the shuffle and of augmentation.
        drop_last: drop the short last batch of each epoch (it is the same size on every rank).
        remainder: ``"pad"`` (every row is read; fewer than ``world_size`` rows are repeated and
            labelled :data:`PAD_LABEL`) or ``"drop"`` (up to ``world_size - 1`` rows unread);
            see :mod:`loaders.plan`.
        shuffle_window: rows shuffled together; also the reader's memory bound (encoded rows).
        num_threads: decode threads; default :func:`default_threads` (one per core this rank
            gets: decode threads never wait on I/O, the reader thread does). On our 2-core
            machine 2 and 4 threads measured alike (``benchmarks/README.md``); a fixed default
            would starve a larger machine.
        prefetch: batches decoded ahead of the training loop.
        decoder: ``"auto"`` (each batch's JPEGs at once with ``loaders._jpeg`` when built; then
            simplejpeg for JPEG when installed, Pillow otherwise), ``"pillow"`` or
            ``"simplejpeg"`` (image by image); see ``loaders/decode.py``.
        augment: random horizontal flip, and a random crop when ``crop`` is set.
        crop: output size; a random crop with ``augment``, a centre crop without.
        normalize: ``(mean, std)`` per channel on the 0-1 scale: images become float32
            ``(x/255 - mean) / std`` instead of uint8.
        pin_memory: pin batches for fast host-to-GPU copies (only when CUDA is available).
        skip_bad_rows: a row that cannot be decoded (or has a label out of range) becomes an
            all-zero image labelled :data:`PAD_LABEL`, is logged and counted in
            :attr:`skipped_rows`, instead of raising :class:`LoaderError`. Read errors (a shard
            that cannot be read) always raise.

    ``len(loader)`` is the number of batches per epoch, the same on every rank, and every rank
    yields exactly that many. Rows labelled :data:`PAD_LABEL` must not count (CrossEntropyLoss
    ignores them by default).

    Read-ahead across epochs: from a loader's second iteration on, once the last batch of an
    epoch is handed to the decode threads, the reader reads the first window of the epoch
    expected next, so that it starts decoding at once instead of after one window's read
    (~15 ms of a ~320 ms epoch of 2,000 224px images here). Expected next: ``epoch + 1`` if
    the last two iterations were one epoch apart (the loop above), the same epoch if they ran
    the same one (a validation loader without ``set_epoch``). What was read ahead is kept
    until that epoch runs, a :meth:`set_epoch` to another epoch or :meth:`close`; the reader
    still holds at most one window of encoded rows. A failed read-ahead is dropped: the epoch
    reads (and reports) it itself.
    """

    def __init__(
        self,
        dataset: str,
        *,
        channel: str = "train",
        rank: int = 0,
        world_size: int = 1,
        batch_size: int = 64,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        remainder: str = "pad",
        shuffle_window: int = 2048,
        num_threads: int | None = None,
        prefetch: int = 4,
        decoder: str = "auto",
        augment: bool = False,
        crop: int | None = None,
        normalize: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None,
        pin_memory: bool = False,
        skip_bad_rows: bool = False,
    ) -> None:
        self.options = LoaderOptions(
            channel=channel, rank=rank, world_size=world_size, batch_size=batch_size, shuffle=shuffle,
            seed=seed, drop_last=drop_last, remainder=remainder, shuffle_window=shuffle_window,
            num_threads=num_threads, prefetch=prefetch, decoder=decoder, augment=augment, crop=crop,
            normalize=normalize, pin_memory=pin_memory, skip_bad_rows=skip_bad_rows,
        )  # fmt: skip
        self.dataset = storage.normalize(dataset)
        self.info = contract.read_dataset_info(self.dataset)
        self.dataset_version = str(self.info.get("dataset_version"))
        self.num_classes = int(self.info["num_classes"])
        self.image_size = int(self.info["image"]["size"])
        if crop is not None and crop > self.image_size:
            raise ConfigError(f"crop must be at most the image size {self.image_size}, got {crop!r}")
        self._pin = pin_memory and torch.cuda.is_available()
        if pin_memory and not self._pin:
            log.info("pin_memory=True ignored: CUDA is not available")

        self.shard_uris, shard_rows = self._shards()
        self.total_rows = sum(shard_rows)
        self.rows_per_rank = rows_per_rank(self.total_rows, world_size, remainder=remainder)
        segments = rank_segments(shard_rows, world_size, rank, remainder=remainder)
        groups = {s: self._row_groups(s, shard_rows[s]) for s in sorted({seg.shard for seg in segments})}
        self._pieces: list[Piece] = split_pieces(segments, groups)
        self._num_batches = num_batches(self.rows_per_rank, batch_size, drop_last=drop_last)
        if self._num_batches == 0:
            raise ConfigError(
                f"batch_size {batch_size} with drop_last=True leaves no batch: each of {world_size} "
                f"ranks reads {self.rows_per_rank} rows of channel {channel!r} of {self.dataset}"
            )

        self._epoch = 0
        self._next_start = 0  # the batch the next iteration starts at (set by load_state_dict)
        self._consumed = 0  # batches of self._epoch consumed so far
        self._pipeline: Pipeline[BatchTask, Any] | None = None
        self._ahead: _Ahead | None = None  # the next epoch's first window, read in advance
        self._last_iter_epoch: int | None = None  # the epoch the last iteration ran
        self._lock = threading.Lock()
        self.skipped_rows: list[SkippedRow] = []
        # Blocks in use at once: one per decode thread, ``prefetch`` queued, the one the reader
        # holds, the one being handed over and the training loop's previous batch.
        self._buffers = BufferPool(keep=self.options.num_threads + prefetch + 3)
        self.stats = PipelineStats()
        self.row_groups_read = 0

    # -- metadata ----------------------------------------------------------------------------------
    def _shards(self) -> tuple[tuple[str, ...], list[int]]:
        channel = self.options.channel
        where = contract.dataset_json_uri(self.dataset)
        try:
            entry = self.info["channels"][channel]
            num_shards = int(self.info["num_shards"])
            listed = entry["shards"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{where} does not describe the shards of channel {channel!r}: missing {exc}") from None
        if len(listed) != num_shards:
            raise DatasetError(f"{where} lists {len(listed)} {channel} shards, expected num_shards={num_shards}")
        uris, rows = [], []
        for i, shard in enumerate(listed):
            expected = contract.shard_uri(self.dataset, channel, i, num_shards)
            uri = storage.join(self.dataset, shard["path"]) if "path" in shard else expected
            if uri != expected:
                raise DatasetError(f"{where}: {channel} shard {i} is {uri}, expected {expected}")
            uris.append(uri)
            rows.append(int(shard["rows"]))
        return tuple(uris), rows

    def _row_groups(self, shard: int, rows: int) -> list[int]:
        """Row-group sizes of one shard, after checking its footer against ``dataset.json``."""
        uri = self.shard_uris[shard]
        try:
            f, pf = _open_parquet(uri)
        except Exception as exc:
            raise DatasetError(f"cannot open shard {uri}: {exc}") from exc
        try:
            md = pf.metadata
            footer = contract.read_footer(md.metadata)
            expected = {
                "dataset_version": self.dataset_version,
                "channel": self.options.channel,
                "shard_index": str(shard),
                "num_shards": str(len(self.shard_uris)),
            }
            for name, want in expected.items():
                got = footer.get(name, "")
                if got != want:
                    raise DatasetError(f"shard {uri} footer says lakeshard.{name}={got!r}, dataset.json implies {want!r}")
            if md.num_rows != rows:
                raise DatasetError(f"shard {uri} has {md.num_rows} rows, dataset.json says {rows}")
            names = set(pf.schema_arrow.names)
            for col in ("image", "label"):
                if col not in names:
                    raise DatasetError(f"shard {uri} has no {col!r} column (columns: {sorted(names)})")
            return [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        finally:
            f.close()

    # -- epochs and state --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._num_batches

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields. Keeps a position restored by
        :meth:`load_state_dict` if ``epoch`` is the restored epoch."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch, self._next_start, self._consumed = epoch, 0, 0
        if self._ahead is not None and self._ahead.epoch != epoch:
            self._ahead = None  # read for another epoch: free it now

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "dataset": self.dataset,
            "dataset_version": self.dataset_version,
            "channel": self.options.channel,
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "order": {**self.options.order_key(), "rows_per_rank": self.rows_per_rank},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off: the next iteration (after ``set_epoch`` of the saved
        epoch, or none) yields exactly the batches that were still to come."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise LoaderError(f"not a ShardLoader state (format {got!r}, expected {STATE_FORMAT!r})")
        if state.get("dataset_version") != self.dataset_version:
            raise DatasetError(
                f"refusing to resume: the loader state was saved on dataset version {state.get('dataset_version')!r} "
                f"({state.get('dataset')}), but {self.dataset} is now version {self.dataset_version!r}; "
                "start a new run (or restore the old dataset)"
            )
        if state.get("channel") != self.options.channel:
            raise LoaderError(f"loader state is for channel {state.get('channel')!r}, this loader reads {self.options.channel!r}")
        mine = {**self.options.order_key(), "rows_per_rank": self.rows_per_rank}
        theirs = state.get("order", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise LoaderError(f"cannot resume: the loader state was saved with other settings ({detail})")
        consumed = state.get("batches_consumed")
        if not isinstance(consumed, int) or not 0 <= consumed <= self._num_batches:
            raise LoaderError(f"batches_consumed must be in [0, {self._num_batches}], got {consumed!r}")
        self.close()
        self._epoch, self._next_start, self._consumed = int(state["epoch"]), consumed, consumed

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._stop_pipeline()
        start, self._next_start = self._next_start, 0
        self._consumed = start
        self.skipped_rows = []
        self.row_groups_read = 0
        spec = DecodeSpec(
            decoder=get_decoder(self.options.decoder), size=self.image_size, num_classes=self.num_classes,
            shard_uris=self.shard_uris, seed=self.options.seed, epoch=self._epoch, rank=self.options.rank,
            crop=self.options.crop, augment=self.options.augment, normalize=self.options.normalize,
            pin_memory=self._pin, skip_bad_rows=self.options.skip_bad_rows, buffers=self._buffers,
            skipped=self.skipped_rows, batch_decoder=get_batch_decoder(self.options.decoder),
        )  # fmt: skip
        # The epoch to read ahead for, from the second iteration on: one step further, as the
        # step from the last iteration to this one (set_epoch(epoch + 1) each time, or the same
        # epoch again, as a validation loader often runs). A loader used once reads nothing more.
        step = None if self._last_iter_epoch is None else self._epoch - self._last_iter_epoch
        self._last_iter_epoch = self._epoch
        return self._run(start, spec, self._epoch + step if step in (0, 1) else None)

    def _run(self, start: int, spec: DecodeSpec, ahead_epoch: int | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        pipeline: Pipeline[BatchTask, Any] = Pipeline(
            self._tasks(self._epoch, start, ahead_epoch),
            lambda task, stop: decode_batch(task, stop, spec),
            num_threads=self.options.num_threads,
            prefetch=self.options.prefetch,
            name=f"lakeshard-r{self.options.rank}",
        )
        with self._lock:
            self._pipeline = pipeline
        self.stats = pipeline.stats
        try:
            while True:
                batch = pipeline.next()
                if batch is None:
                    break
                self._consumed += 1
                yield batch
        finally:
            pipeline.close()
            with self._lock:
                if self._pipeline is pipeline:
                    self._pipeline = None
            if self.skipped_rows:
                log.warning(
                    "skipped %d bad rows of channel %r in epoch %d (rank %d)",
                    len(self.skipped_rows), self.options.channel, self._epoch, self.options.rank,
                )  # fmt: skip

    def close(self) -> None:
        """Stop the running epoch's threads (if any) and wait for them; drop what was read
        ahead for the next epoch."""
        self._stop_pipeline()
        self._ahead = None

    def _stop_pipeline(self) -> None:
        with self._lock:
            pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the reader thread -------------------------------------------------------------------------
    def _tasks(self, epoch: int, start: int, ahead_epoch: int | None = None) -> Iterator[BatchTask]:
        """Batch tasks of ``epoch`` from batch ``start`` on, then the first window of
        ``ahead_epoch`` read ahead (if given); runs on the reader thread."""
        opts = self.options
        bs = opts.batch_size
        order = self._order(epoch)
        end = min(self._num_batches * bs, self.rows_per_rank)
        pos = start * bs
        if pos >= end:
            return
        files: dict[int, tuple[Any, pq.ParquetFile]] = {}
        carry: list[Any] = []  # rows read but not yet in a task: [images, labels, pads, shards, rows]
        index = start
        ahead, self._ahead = self._ahead, None
        try:
            for w in range(order.window_at(pos), len(order.windows)):
                if ahead is not None and ahead.epoch == epoch and w == 0:
                    cols = ahead.cols
                else:
                    cols = self._read_window([self._pieces[int(p)] for p in order.windows[w]], files)
                ahead = None
                self.row_groups_read += len(order.windows[w])
                perm = order.perms[w]
                lo = max(pos - int(order.starts[w]), 0)
                hi = min(end - int(order.starts[w]), len(perm))
                perm = perm[lo:hi]
                images = cols[0]
                window = [[images[j] for j in perm.tolist()], *(c[perm] for c in cols[1:])]
                if carry:
                    window = [carry[0] + window[0], *(np.concatenate([a, b]) for a, b in zip(carry[1:], window[1:], strict=True))]
                n = len(window[0])
                k = 0
                while n - k >= bs:
                    yield BatchTask(index, window[0][k : k + bs], *(c[k : k + bs] for c in window[1:]))
                    index, k = index + 1, k + bs
                carry = [window[0][k:], *(c[k:] for c in window[1:])] if k < n else []
                # The tasks hold their rows now: let each row go once its batch is decoded,
                # instead of keeping the whole window until the next one is read.
                cols = window = images = None
                if int(order.starts[w + 1]) >= end:
                    break
            if carry and len(carry[0]):
                yield BatchTask(index, *carry)
        finally:
            for f, _ in files.values():
                f.close()
        # Every task of this epoch is handed over (a close() or an error never gets here). While
        # the decode threads finish its last batches, read the first window of the epoch that
        # is expected next, so that it starts decoding at once instead of after a window's read.
        if ahead_epoch is not None:
            self._ahead = self._read_ahead(ahead_epoch)

    def _order(self, epoch: int) -> EpochOrder:
        opts = self.options
        return epoch_order(
            [p.rows for p in self._pieces], shuffle=opts.shuffle, seed=opts.seed, epoch=epoch,
            rank=opts.rank, window_rows=opts.shuffle_window,
        )  # fmt: skip

    def _read_ahead(self, epoch: int) -> _Ahead | None:
        order = self._order(epoch)
        files: dict[int, tuple[Any, pq.ParquetFile]] = {}
        try:
            return _Ahead(epoch, self._read_window([self._pieces[int(p)] for p in order.windows[0]], files))
        except LoaderError as exc:  # that epoch reads it again, and raises if it still fails
            log.debug("could not read ahead into epoch %d: %s", epoch, exc)
            return None
        finally:
            for f, _ in files.values():
                f.close()

    def _read_window(self, pieces: list[Piece], files: dict[int, tuple[Any, pq.ParquetFile]]) -> list[Any]:
        images: list[bytes | None] = []
        labels, pads, shards, rows = [], [], [], []
        for piece in pieces:
            uri = self.shard_uris[piece.shard]
            where = f"row group {piece.row_group} (rows {piece.start}-{piece.stop - 1}) of {uri}"
            try:
                if piece.shard not in files:
                    files[piece.shard] = _open_parquet(uri)
                pf = files[piece.shard][1]
                columns = [c for c in _COLUMNS if c in pf.schema_arrow.names]
                # One thread: the decode threads keep the cores busy; Arrow's pool only adds hand-offs.
                table = pf.read_row_group(piece.row_group, columns=columns, use_threads=False)
            except Exception as exc:
                raise LoaderError(f"cannot read {where}: {type(exc).__name__}: {exc}") from exc
            table = table.slice(piece.start - piece.group_start, piece.rows)
            if table.num_rows != piece.rows:
                raise LoaderError(f"{where}: expected {piece.rows} rows, read {table.num_rows} (shard changed?)")
            # Copies: one ``bytes`` per row, the copy made without the GIL (``_binary_rows``).
            # Zero-copy views of the Arrow buffers were tried twice: the first time, each queued
            # task pinned its whole window (peak RSS on the 10x shard of
            # benchmarks/loader_memory.py 1.11x); the second, with the reader letting go of each
            # window, RSS was fine but a new loader's epoch got ~8% slower (the buffers die on
            # decode threads, far from the thread that read them). Copying each row group into one
            # reused block (no GIL) was 2-3% faster at 2,000 rows an epoch and 1-2% slower at 10,000.
            images.extend(_binary_rows(table.column("image")))
            labels.append(_int64s(table.column("label"), null=NULL_LABEL))  # a bad row
            pad = np.full(piece.rows, piece.pad, dtype=bool)
            if "is_pad" in table.column_names:
                pad |= _int64s(table.column("is_pad"), null=0).astype(bool)
            pads.append(pad)
            shards.append(np.full(piece.rows, piece.shard, dtype=np.int32))
            rows.append(np.arange(piece.start, piece.stop, dtype=np.int64))
        return [images, np.concatenate(labels), np.concatenate(pads), np.concatenate(shards), np.concatenate(rows)]

