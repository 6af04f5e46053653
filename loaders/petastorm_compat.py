"""Read our shards with petastorm: a ``TransformSpec`` that decodes the ``image`` column.

```python
from petastorm import make_batch_reader
from petastorm.pytorch import DataLoader
from loaders.petastorm_compat import make_transform_spec

spec = make_transform_spec(size=32)                  # dataset.json["image"]["size"]
urls = [f"file:///data/pets-v1/shards/channel=train/part-0000{i}-of-00002.parquet" for i in range(2)]
with make_batch_reader(urls, transform_spec=spec, num_epochs=1) as reader:
    for batch in DataLoader(reader, batch_size=64):
        images, labels = batch["image"], batch["label"]   # uint8 [B, H, W, 3], int64 [B]
```

petastorm 0.12.1 needs pyarrow 14 and numpy < 2, so it runs in its own environment
(``scripts/setup_petastorm.sh``); see ``docs/petastorm.md``. petastorm is imported inside
:func:`make_transform_spec`, so this module imports without it.

The transform runs on petastorm's worker threads, one row group at a time, and receives the
row group as a pandas DataFrame. It decodes each image (Pillow, which releases the GIL), checks
it is ``size`` x ``size`` (petastorm collates rows only into fixed shapes), drops the rows the
shard job marked ``is_pad`` (copies written by the ``pad`` remainder policy) unless asked not
to, and keeps ``fields``.

A multi-label dataset's ``label_indices`` are lists of varying length, which petastorm cannot
collate: the field ``labels`` (with ``num_classes``) is them as a multi-hot ``float32
[num_classes]``, as the loader's :class:`~loaders.Batch` names it. A boxes dataset's ``boxes``
(a list of structs) petastorm leaves out of the schema it infers, so no transform can read them:
read boxes with the loader (``docs/petastorm.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lakeshard.format import SHARD_SCHEMA
from lakeshard.settings import check_positive
from loaders.decode import get_decoder

__all__ = ["LAYOUTS", "decode_images", "make_transform_spec"]

#: ``hwc``: ``[H, W, 3]`` as decoders return it; ``chw``: ``[3, H, W]`` as torch models take it.
LAYOUTS = ("hwc", "chw")

#: Columns of a shard a transform may keep, and ``labels`` (multi-hot, made from ``label_indices``).
_SHARD_COLUMNS = (*SHARD_SCHEMA.names, "labels", "label_indices")


def decode_images(
    images: Sequence[bytes],
    *,
    size: int,
    layout: str = "hwc",
    decoder: str = "pillow",
    uris: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """Decode encoded images into C-contiguous ``uint8`` arrays of one fixed shape.

    Raises:
        ValueError: an image cannot be decoded or is not ``size`` x ``size``; the message names
            the row's ``uri`` when ``uris`` is given.
    """
    decode = get_decoder(decoder)
    out = []
    for i, data in enumerate(images):
        try:
            arr = decode(data, np.empty((size, size, 3), np.uint8))
        except Exception as exc:
            where = uris[i] if uris is not None else f"row {i} of the row group"
            raise ValueError(f"cannot decode the image of {where}: {type(exc).__name__}: {exc}") from exc
        out.append(np.ascontiguousarray(arr.transpose(2, 0, 1)) if layout == "chw" else arr)
    return out


def make_transform_spec(
    size: int,
    *,
    layout: str = "hwc",
    fields: Sequence[str] = ("image", "label"),
    drop_padding: bool = True,
    decoder: str = "pillow",
    num_classes: int | None = None,
) -> Any:
    """A ``petastorm.TransformSpec`` that decodes the ``image`` column of our shards.

    Args:
        size: the dataset's image size (``dataset.json["image"]["size"]``): every image is
            ``size`` x ``size`` RGB.
        layout: ``"hwc"`` (``uint8 [H, W, 3]``) or ``"chw"`` (``uint8 [3, H, W]``).
        fields: the columns the reader yields, in this order; ``image`` is decoded. Strings
            (``uri``, ``key``) suit ``make_batch_reader`` but not ``petastorm.pytorch.DataLoader``,
            which refuses string columns.
        drop_padding: drop rows marked ``is_pad`` (the shard job's ``pad`` policy repeats rows
            to even out shards), so every row of the lake arrives once. Needs the ``is_pad``
            column to be read (it is, unless ``schema_fields`` leaves it out).
        decoder: a decoder of :mod:`loaders.decode` (``"pillow"``, ``"auto"``, ``"simplejpeg"``).
        num_classes: a multi-label dataset's ``num_classes`` (``dataset.json``), for the field
            ``labels``: the row's ``label_indices`` as a multi-hot ``float32 [num_classes]``.

    Returns:
        A ``petastorm.TransformSpec`` for ``make_batch_reader(..., transform_spec=...)``.
    """
    import pandas as pd
    from petastorm import TransformSpec

    fields = list(fields)
    edit = _edit_fields(size, layout, fields, num_classes)
    classes = num_classes or 0
    get_decoder(decoder)  # fail here, not on a worker thread

    def transform(df: Any) -> Any:
        if drop_padding:
            if "is_pad" not in df.columns:
                raise ValueError(
                    "drop_padding=True needs the is_pad column: add it to schema_fields "
                    "or pass drop_padding=False"
                )
            df = df[~df["is_pad"].astype(bool)]
        df = df.reset_index(drop=True)
        uris = df["uri"].tolist() if "uri" in df.columns else None
        if "image" in fields:
            decoded = decode_images(
                df["image"].tolist(), size=size, layout=layout, decoder=decoder, uris=uris
            )
            df["image"] = pd.Series(decoded, index=df.index, dtype=object)  # one array per cell
        if "labels" in fields:
            hot = [_multi_hot(indices, classes) for indices in df["label_indices"]]
            df["labels"] = pd.Series(hot, index=df.index, dtype=object)
        return df[fields]

    return TransformSpec(transform, edit_fields=edit, selected_fields=fields)


def _edit_fields(
    size: int, layout: str, fields: list[str], num_classes: int | None
) -> list[tuple[str, Any, tuple[int, ...], bool]]:
    """petastorm's ``edit_fields`` of the fields the transform makes (checked: a ``ValueError``
    names the bad argument)."""
    check_positive("size", size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    unknown = [f for f in fields if f not in _SHARD_COLUMNS]
    if unknown or not fields:
        raise ValueError(f"fields must name shard columns {_SHARD_COLUMNS}, got {fields!r}")
    edit: list[tuple[str, Any, tuple[int, ...], bool]] = []
    if "image" in fields:
        edit.append(("image", np.uint8, (size, size, 3) if layout == "hwc" else (3, size, size), False))
    if "labels" in fields:
        check_positive("num_classes", num_classes)
        edit.append(("labels", np.float32, (num_classes or 0,), False))
    return edit


def _multi_hot(indices: Sequence[int], num_classes: int) -> np.ndarray:
    hot = np.zeros(num_classes, np.float32)
    hot[np.asarray(indices, dtype=np.int64)] = 1.0
    return hot
