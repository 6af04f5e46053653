"""Tiny datasets on disk, written through the format's own writer (``lakeshard.format``:
:class:`ShardWriter`, the layout's paths, :class:`DatasetInfo`) without the jobs, so loader
tests make exactly the rows they need.

Every row's image is a flat colour that encodes a unique sample id: red = id mod 256, green =
id div 256. With PNG (lossless) :func:`ids_of` reads the ids back out of decoded batches, so
tests check *which* samples came out, through the real decode path.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from lakeshard import format as contract
from lakeshard import storage
from lakeshard.format.label_columns import shard_fields, shard_schema

CHANNEL_OFFSET = {"train": 0, "validation": 20_000, "test": 40_000}
#: The labels table's kept columns of the multi-label and boxes datasets written here.
KEPT = pa.schema([pa.field("caption", pa.string()), pa.field("score", pa.float64())])
#: The colour of the shape drawn in each box of a boxes dataset (pure white: no background is).
BOX_COLOUR = (255, 255, 255)
#: The colour of each class's stripe in a multi-label dataset (no background has blue 255).
CLASS_COLOURS = ((0, 0, 255), (0, 255, 255), (255, 0, 255), (255, 255, 255))


def labels_of(sample_id: int, num_classes: int) -> list[int]:
    """The classes of sample ``sample_id`` in a multi-label dataset: its own, and the next one for
    odd ids (sorted)."""
    own = sample_id % num_classes
    return sorted({own, (own + 1) % num_classes} if sample_id % 2 else {own})


def box_of(sample_id: int, size: int) -> tuple[int, int, int, int]:
    """``(x, y, width, height)`` of the one box of sample ``sample_id`` in a boxes dataset."""
    width, height = size // 4 + sample_id % 3, size // 5 + sample_id % 4
    return (sample_id * 7) % (size - width), (sample_id * 5) % (size - height), width, height


def caption_ids(batch: Any) -> list[int]:
    """Each row's sample id, from a multi-label or boxes batch's kept column ``caption``
    (``"sample <id>"``)."""
    return [int(c.split()[1]) for c in batch["caption"]]


def assert_same_batches(a: list[Any], b: list[Any]) -> None:
    """Named batches alike: their images, labels, boxes and boxes' classes, and rows (by id)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels)
        assert all(torch.equal(p, q) for p, q in zip(x.boxes, y.boxes, strict=True))
        assert all(torch.equal(p, q) for p, q in zip(x.box_labels, y.box_labels, strict=True))
        assert caption_ids(x) == caption_ids(y)


def check_exact_resume(make: Callable[[], Any], *, epoch: int = 1, taken: int = 2) -> None:
    """The first ``taken`` batches of ``epoch`` of a loader ``make()`` builds, then the rest out
    of another resumed from its state: the batches of a third's whole epoch."""
    with make() as whole:
        whole.set_epoch(epoch)
        expected = list(whole)
    with make() as first:
        first.set_epoch(epoch)
        it = iter(first)
        got = [next(it) for _ in range(taken)]
        state = first.state_dict()
    with make() as again:
        again.load_state_dict(state)
        again.set_epoch(epoch)
        got += list(again)
    assert_same_batches(got, expected)


def check_remote_alike(local: Callable[[], Any], remote: Callable[[], Any]) -> None:
    """Epochs 0 and 1 of a loader ``remote()`` builds (the second read from its cache, if it has
    one) are those of a loader ``local()`` builds."""

    def epoch(loader: Any, e: int) -> list[Any]:
        loader.set_epoch(e)
        return list(loader)

    with local() as here:
        expected = [epoch(here, e) for e in (0, 1)]
    with remote() as far:
        for e in (0, 1):
            assert_same_batches(epoch(far, e), expected[e])


def ids_over_an_elastic_resume(make: Callable[..., Any], *, taken: int = 2) -> list[int]:
    """The valid rows (by id, sorted) of an epoch taken over an elastic resume: 2 ranks of
    batch 6 take ``taken`` batches each, then 3 ranks of batch 4 resumed from rank 0's state
    take the rest. ``make(rank=, world_size=, batch_size=)`` builds a loader."""
    seen: list[int] = []

    def take(batches: Iterable[Any]) -> None:
        for b in batches:
            seen.extend(s for s, ok in zip(caption_ids(b), b.valid.tolist(), strict=True) if ok)

    with make(rank=0, world_size=2, batch_size=6) as r0, make(rank=1, world_size=2, batch_size=6) as r1:
        for loader in (r0, r1):
            it = iter(loader)
            take(next(it) for _ in range(taken))
        state = r0.state_dict()
    for rank in range(3):
        with make(rank=rank, world_size=3, batch_size=4) as loader:
            loader.load_state_dict(state)
            loader.set_epoch(state["epoch"])
            take(loader)
    return sorted(seen)


def drawn_box(image: torch.Tensor) -> list[float] | None:
    """``x0, y0, x1, y1`` of the pixels of :data:`BOX_COLOUR` in a ``[3, H, W]`` image (``None``:
    none): where the drawn shape is, read off the pixels."""
    mask = (image == torch.tensor(BOX_COLOUR, dtype=image.dtype).view(3, 1, 1)).all(dim=0)
    ys, xs = torch.nonzero(mask, as_tuple=True)
    if not len(xs):
        return None
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


def _task_columns(
    ids: list[int], size: int, task: str, num_classes: int, names: dict[int, str]
) -> dict[str, pa.Array]:
    """The label columns (and the kept ones) of rows ``ids`` of a ``task`` dataset whose class
    ``c`` is named ``names[c]``."""
    sets = [labels_of(i, num_classes) if task == "multi-label" else [i % num_classes] for i in ids]
    columns = {
        "labels": pa.array([[names[c] for c in s] for s in sets], pa.list_(pa.string())),
        "label_indices": pa.array(sets, pa.list_(pa.int64())),
    }
    if task == "boxes":
        boxes = []
        for i in ids:
            x, y, w, h = box_of(i, size)
            c = i % num_classes
            boxes.append([{"label": names[c], "label_index": c, "x": x, "y": y, "width": w, "height": h}])
        columns["boxes"] = pa.array(boxes, pa.list_(contract.BOX_TYPE))
    columns["caption"] = pa.array([f"sample {i}" for i in ids], pa.string())
    columns["score"] = pa.array([i / 2 for i in ids], pa.float64())
    return columns


def _draw_shapes(image: bytes, sample_id: int, size: int, fmt: str, task: str, num_classes: int) -> bytes:
    """``image`` with sample ``sample_id``'s shapes in :data:`BOX_COLOUR`, encoded again as
    ``fmt``: its box (``boxes``), or a stripe of colour :data:`CLASS_COLOURS` ``[c]`` across the
    image's ``c``-th quarter from the top for each of its classes ``c`` (``multi-label``, 4
    classes at most: what a model can learn them by, a horizontal flip or not)."""
    arr = np.asarray(Image.open(io.BytesIO(image)).convert("RGB")).copy()
    if task == "boxes":
        x, y, w, h = box_of(sample_id, size)
        arr[y : y + h, x : x + w] = BOX_COLOUR
    else:
        quarter = size // 4
        for c in labels_of(sample_id, num_classes):
            arr[c * quarter + quarter // 4 : (c + 1) * quarter - quarter // 4] = CLASS_COLOURS[c]
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG" if fmt == "jpeg" else "PNG", quality=95)
    return buf.getvalue()


def _write_task_shard(uri: str, table: pa.Table, meta: dict[str, object], row_group_rows: int) -> dict:
    """A multi-label or boxes shard (the format's writer takes single-label rows only): its stats
    as :attr:`ShardWriter.stats` gives them, label counts by class index."""
    path = storage.filesystem(uri)[1]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    schema = table.schema.with_metadata(contract.footer_metadata(meta))
    pq.write_table(table.cast(schema), path, row_group_size=row_group_rows)
    data = Path(path).read_bytes()
    counts: dict[str, int] = {}
    for indices in table.column("label_indices").to_pylist():
        for c in indices:
            counts[str(c)] = counts.get(str(c), 0) + 1
    return {
        "rows": table.num_rows,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "row_groups": pq.ParquetFile(path).num_row_groups,
        "label_counts": dict(sorted(counts.items())),
    }


def encode_image(sample_id: int, size: int, fmt: str, *, noise: bool = False) -> bytes:
    arr = np.empty((size, size, 3), dtype=np.uint8)
    arr[..., 0] = sample_id % 256
    arr[..., 1] = (sample_id // 256) % 256
    arr[..., 2] = 17
    if noise:  # texture, for augmentation tests: every pixel differs
        rng = np.random.default_rng(sample_id)
        arr[..., 2] = rng.integers(0, 256, size=(size, size), dtype=np.uint8)
    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    else:
        Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def ids_of(images: torch.Tensor) -> list[int]:
    """Sample ids encoded in uint8 [B, 3, H, W] images."""
    red = images[:, 0, 0, 0].to(torch.int64)
    green = images[:, 1, 0, 0].to(torch.int64)
    return (red + 256 * green).tolist()


def shard_path(root: Path, channel: str, index: int, count: int) -> Path:
    """The local path of a shard of the dataset at ``root``."""
    return root / contract.shard_relpath(channel, index, count)


def write_dataset(
    root: Path,
    *,
    rows: dict[str, int] | None = None,
    num_shards: int = 2,
    size: int = 8,
    fmt: str = "png",
    num_classes: int = 3,
    row_group_rows: int = 5,
    version: str = "0123abcd",
    corrupt: Iterable[tuple[str, int, int]] = (),
    pad_rows: int = 0,
    noise: bool = False,
    first_id: int = 0,
    label_names: list[str] | None = None,
    task: str | None = None,
) -> contract.DatasetInfo:
    """Write a complete dataset under ``root``; return its ``dataset.json``.

    ``rows[channel]`` rows per channel (the remainder over ``num_shards`` is dropped);
    ``corrupt`` lists ``(channel, shard, row)`` whose image bytes are garbage; the last
    ``pad_rows`` rows of the last shard of each channel are marked ``is_pad``. Sample ids start
    at ``first_id`` (datasets meant to be mixed get ids apart); ``label_names`` replaces
    ``class0, class1, ...`` (the label of sample ``i`` is ``i % num_classes`` either way).
    ``task``: ``multi-label`` (the classes :func:`labels_of`) or ``boxes`` (one box per image,
    :func:`box_of`, drawn in :data:`BOX_COLOUR`), with the kept columns :data:`KEPT` (``caption``:
    ``"sample <id>"``, ``score``: id / 2); format version 4.
    """
    rows = rows or {"train": 40, "validation": 12, "test": 12}
    corrupt = set(corrupt)
    label_names = label_names or [f"class{i}" for i in range(num_classes)]
    labels = {name: i for i, name in enumerate(label_names[:num_classes])}
    names = {i: name for name, i in labels.items()}
    uri = storage.normalize(str(root))
    meta = {
        "dataset_version": version,
        "num_shards": num_shards,
        "format_version": contract.FORMAT_VERSION if task is None else contract.TASK_FORMAT_VERSION,
        "image_format": fmt,
        "image_size": size,
    }
    channels: dict[str, contract.ChannelInfo] = {}
    for channel in contract.CHANNELS:
        per_shard = rows.get(channel, 0) // num_shards
        shards = []
        for s in range(num_shards):
            ids = [first_id + CHANNEL_OFFSET[channel] + s * per_shard + j for j in range(per_shard)]
            images = [encode_image(i, size, fmt, noise=noise) for i in ids]
            if task is not None:
                images = [
                    _draw_shapes(image, i, size, fmt, task, num_classes)
                    for image, i in zip(images, ids, strict=True)
                ]
            for c_channel, c_shard, c_row in corrupt:
                if (c_channel, c_shard) == (channel, s):
                    images[c_row] = b"\xff\xd8\xff this is not an image"
            table = pa.table(
                {
                    "image": pa.array(images, pa.binary()),
                    "label": pa.array([i % num_classes for i in ids], pa.int64()),
                    "uri": pa.array(
                        [f"file:///raw/{names[i % num_classes]}/{i}.{fmt}" for i in ids], pa.string()
                    ),
                    "key": pa.array([f"{names[i % num_classes]}/{i}.{fmt}" for i in ids], pa.string()),
                    "height": pa.array([size] * per_shard, pa.int32()),
                    "width": pa.array([size] * per_shard, pa.int32()),
                    "is_pad": pa.array(
                        [s == num_shards - 1 and j >= per_shard - pad_rows for j in range(per_shard)],
                        pa.bool_(),
                    ),
                },
                schema=contract.SHARD_SCHEMA,
            )
            if task is not None:
                table = table.set_column(1, "label", pa.nulls(per_shard, pa.int64()))
                for name, column in _task_columns(ids, size, task, num_classes, names).items():
                    table = table.append_column(name, column)
                table = table.cast(shard_schema(task, KEPT))
                stats = _write_task_shard(
                    contract.shard_uri(uri, channel, s, num_shards),
                    table,
                    {**meta, "channel": channel, "shard_index": s},
                    row_group_rows,
                )
                shards.append(contract.ShardInfo.from_stats(channel, s, num_shards, stats, names))
                continue
            writer = contract.ShardWriter(
                contract.shard_uri(uri, channel, s, num_shards),
                metadata={**meta, "channel": channel, "shard_index": s},
                row_group_bytes=1 << 40,
                row_group_rows=row_group_rows,
            )
            with writer:
                writer.write(table)
            shards.append(contract.ShardInfo.from_stats(channel, s, num_shards, writer.stats, names))
        channels[channel] = contract.ChannelInfo.of_shards(shards)
    info = contract.DatasetInfo(
        format_version=meta["format_version"],
        dataset_version=version,
        created_at="2026-01-01T00:00:00+00:00",
        engine="tests.loaders.loader_builders",
        inputs=contract.Inputs(
            lake="file:///raw",
            manifest_fingerprint="0" * 16,
            split={c: 1 / len(contract.CHANNELS) for c in contract.CHANNELS},
            split_method="stratified",
            manifest_seed=7,
        ),
        seed=7,
        labels=labels,
        num_classes=num_classes,
        image=contract.ImageSpec(size=size, format=fmt, quality=95, resize="crop", max_pixels=1 << 24),
        num_shards=num_shards,
        remainder="drop",
        row_group_bytes=1 << 40,
        counts=contract.Counts(
            listed=sum(c.rows for c in channels.values()),
            manifest_rejects=0,
            shard_rejects=0,
            dropped=0,
            padded=0,
        ),
        build=contract.BuildInfo(preprocess_tasks=0, preprocessed=0, reused_segments=0, assembled_shards=0),
        channels=channels,
        rejects_path=contract.shard_rejects_relpath(),
        versions={"python": "3"},
        task=task,
        columns=None if task is None else {f.name: str(f.type) for f in shard_fields(task, KEPT)},
    )
    storage.write_json_atomic(contract.labels_uri(uri), labels)
    storage.write_json_atomic(contract.dataset_json_uri(uri), info.to_json())
    return info


def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait until ``condition()`` holds; fail the test, saying ``what``, after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting ({timeout:.0f} s) until {what}")
        time.sleep(0.01)
