"""What the benchmark tools build: synthetic images (:func:`synthetic_image`, and
:func:`photo_image` with a photo's bytes), their JPEGs, and datasets of them written by the
format's own :class:`lakeshard.format.ShardWriter`, so the loader reads what it reads in
production. Not a tool: imported by the tools beside it."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import multiprocessing
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.shard_steps.config import ShardConfig
from lakeshard import format as contract
from lakeshard.format import ShardWriter
from lakeshard.settings import parse_size

__all__ = [
    "PHOTO_QUALITY",
    "ROW_GROUP_BYTES",
    "build_dataset",
    "cached_dataset",
    "field_image",
    "jpeg",
    "lake_jpeg",
    "photo_image",
    "seeded_jpeg",
    "synthetic_image",
    "synthetic_jpegs",
    "write_lake",
    "write_shards",
]

#: The shard job's default row-group size.
ROW_GROUP_BYTES = parse_size(
    next(f.default for f in dataclasses.fields(ShardConfig) if f.name == "row_group_size")
)


def field_image(rng: np.random.Generator, width: int, height: int, noise: float) -> np.ndarray:
    """A smooth colour field (upsampled coarse noise) plus fine noise of deviation ``noise`` and
    a gradient, ``height x width x 3`` uint8."""
    coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.float32)
    ramp = np.linspace(-40, 40, width, dtype=np.float32)[None, :, None]
    fine = rng.normal(0, noise, size=(height, width, 3)).astype(np.float32)
    return np.clip(field + ramp + fine, 0, 255).astype(np.uint8)


def synthetic_image(rng: np.random.Generator, size: int) -> np.ndarray:
    """A square :func:`field_image` with weak fine noise: JPEG sizes like photos (~10-20 KB at
    224px, quality 90)."""
    return field_image(rng, size, size, 6)


#: :func:`photo_image`'s noise and the JPEG quality it is meant for: ~100 kB at 224px.
PHOTO_NOISE, PHOTO_QUALITY = 80.0, 100


def photo_image(rng: np.random.Generator, size: int) -> np.ndarray:
    """:func:`synthetic_image` with strong fine noise: ~97 kB a 224px JPEG at quality 100 (a
    photo's bytes at the same decode size)."""
    noisy = synthetic_image(rng, size).astype(np.float32) + rng.normal(0, PHOTO_NOISE, size=(size, size, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, quality: int) -> bytes:
    """``pixels`` (``H x W x 3`` uint8) encoded as a JPEG by Pillow."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def synthetic_jpegs(
    n: int,
    size: int,
    quality: int,
    *,
    draw: Callable[[np.random.Generator, int], np.ndarray] = synthetic_image,
) -> list[bytes]:
    """``n`` JPEGs drawn one after another by ``draw(rng, size)`` from one generator seeded 0."""
    rng = np.random.default_rng(0)
    return [jpeg(draw(rng, size), quality) for _ in range(n)]


#: The raw lake of the jobs benchmark (:func:`lake_jpeg`): its JPEG quality and fine noise, and
#: the EXIF orientations that every fifth image is stored with, in turn (a camera held upright or
#: upside down: the shard job turns them back).
LAKE_QUALITY, LAKE_NOISE = 90, 10.0
LAKE_ORIENTATIONS = (6, 8, 3)


def lake_jpeg(i: int) -> bytes:
    """Image ``i`` of the jobs benchmark's raw lake, drawn with its own seed ``i`` (a process
    pool makes them in any order): photo-like, 320 to 680 px wide and 0.62 to 0.94 of that high
    (about 500x390 and 68 kB on average), every fifth one with an EXIF orientation."""
    rng = np.random.default_rng([7, i])
    width = int(rng.integers(320, 681))
    height = int(width * rng.uniform(0.62, 0.94))
    exif = Image.Exif()
    if i % 5 == 4:
        exif[0x0112] = LAKE_ORIENTATIONS[(i // 5) % len(LAKE_ORIENTATIONS)]
    buf = io.BytesIO()
    Image.fromarray(field_image(rng, width, height, LAKE_NOISE)).save(
        buf, format="JPEG", quality=LAKE_QUALITY, exif=exif.tobytes()
    )
    return buf.getvalue()


def write_lake(root: Path, *, images: int, classes: int, workers: int) -> Path:
    """The raw lake ``root/class<c>/<i>.jpg`` of ``images`` :func:`lake_jpeg` images, image
    ``i`` in class ``i % classes``, made by ``workers`` processes once (a ``.complete`` file
    records the count; another count makes it anew). Returns ``root``."""
    marker = root / ".complete"
    want = json.dumps({"images": images, "classes": classes})
    if marker.exists() and marker.read_text() == want:
        return root
    shutil.rmtree(root, ignore_errors=True)
    for c in range(classes):
        (root / f"class{c:02d}").mkdir(parents=True)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for i, data in enumerate(pool.imap(lake_jpeg, range(images), chunksize=16)):
            (root / f"class{i % classes:02d}" / f"{i:06d}.jpg").write_bytes(data)
    marker.write_text(want)
    return root


def seeded_jpeg(job: tuple[int, int, int]) -> bytes:
    """Image ``i`` of ``(i, size, quality)`` as a JPEG, drawn with its own seed ``i`` (so a
    process pool can make them in any order)."""
    i, size, quality = job
    return jpeg(synthetic_image(np.random.default_rng(i), size), quality)


def build_dataset(
    root: Path,
    *,
    images: int,
    size: int,
    quality: int,
    classes: int = 10,
    image: Callable[[np.random.Generator, int], np.ndarray] = synthetic_image,
) -> None:
    """One shard per channel following the contract (:func:`write_shards`), plus the same
    JPEGs as files under ``root/files``. ``image(rng, size)`` draws each image
    (``remote_bench.py --photo`` draws noisier ones)."""
    encoded = synthetic_jpegs(images, size, quality, draw=image)
    labels = [i % classes for i in range(images)]
    for i, data in enumerate(encoded):
        path = root / "files" / f"class{labels[i]}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    write_shards(root, encoded, labels, size=size, quality=quality, classes=classes)


def cached_dataset(cache: Path, *, images: int, size: int, quality: int = 90) -> Path:
    """:func:`build_dataset` of ``images`` under ``cache``, built once (per format version: a
    new format, a new dataset)."""
    root = cache / f"v{contract.FORMAT_VERSION}-{images}-{size}"
    if not (root / "dataset.json").exists():
        build_dataset(root, images=images, size=size, quality=quality)
    return root


def write_shards(
    root: Path,
    encoded: list[bytes],
    labels: list[int],
    *,
    size: int,
    quality: int,
    classes: int,
    row_group_bytes: int = ROW_GROUP_BYTES,
) -> None:
    """A dataset of one shard per channel (train: every image; validation and test: the first
    ``classes``, at most 10), written by the format's own :class:`lakeshard.format.ShardWriter` (so the
    image column is stored as the job stores it: uncompressed, no dictionary, 4 MiB row groups),
    with its ``dataset.json`` and ``labels.json``; ``row_group_bytes``: the writer's."""
    images = len(encoded)
    version = hashlib.sha256(b"".join(encoded[:10])).hexdigest()[:16]
    names = {c: f"class{c}" for c in range(classes)}
    channels: dict[str, contract.ChannelInfo] = {}
    for channel in contract.CHANNELS:
        n = images if channel == "train" else min(classes, 10)
        table = pa.table(
            {
                "image": pa.array(encoded[:n], pa.binary()),
                "label": pa.array(labels[:n], pa.int64()),
                "uri": pa.array([f"file:///bench/{i}.jpg" for i in range(n)]),
                "key": pa.array([f"{i}.jpg" for i in range(n)]),
                "height": pa.array([size] * n, pa.int32()),
                "width": pa.array([size] * n, pa.int32()),
                "is_pad": pa.array([False] * n),
            },
            schema=contract.SHARD_SCHEMA,
        )
        meta = {
            "dataset_version": version,
            "channel": channel,
            "shard_index": 0,
            "num_shards": 1,
            "format_version": contract.FORMAT_VERSION,
            "image_format": "jpeg",
            "image_size": size,
        }
        with ShardWriter(
            contract.shard_uri(str(root), channel, 0, 1), metadata=meta, row_group_bytes=row_group_bytes
        ) as writer:
            writer.write(table)
        channels[channel] = contract.ChannelInfo.of_shards(
            [contract.ShardInfo.from_stats(channel, 0, 1, writer.stats, names)]
        )
    info = contract.DatasetInfo(
        format_version=contract.FORMAT_VERSION,
        dataset_version=version,
        created_at="",
        engine="loader_bench",
        inputs=contract.Inputs(
            lake=(root / "files").as_uri(),
            manifest_fingerprint=version,
            split={"train": 1.0},
            split_method="none",
            manifest_seed=0,
        ),
        seed=0,
        labels={name: c for c, name in names.items()},
        num_classes=classes,
        image=contract.ImageSpec(
            size=size, format="jpeg", quality=quality, resize="crop", max_pixels=size * size
        ),
        num_shards=1,
        remainder="drop",
        row_group_bytes=row_group_bytes,
        counts=contract.Counts(listed=images, manifest_rejects=0, shard_rejects=0, dropped=0, padded=0),
        build=contract.BuildInfo(
            preprocess_tasks=0, preprocessed=images, reused_segments=0, assembled_shards=0
        ),
        channels=channels,
        rejects_path=contract.shard_rejects_relpath(),
        versions={},
    )
    (root / "labels.json").write_text(json.dumps(info.labels))
    (root / "dataset.json").write_text(json.dumps(info.to_json()))
