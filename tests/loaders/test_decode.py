"""Decoders read zero-copy views as well as bytes, and refuse an image of the wrong size."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from loader_builders import ids_of, shard_path, write_dataset
from PIL import Image

from lakeshard.errors import LoaderError
from loaders import PAD_LABEL, ShardLoader, decode
from loaders._internal import arrow_columns, extensions
from loaders._internal.arrow_columns import binary_rows as _binary_rows
from loaders._internal.arrow_columns import int64_column as _int64s

# The optional extensions, as this process has them (built, and LAKESHARD_NO_EXTENSIONS unset):
# each test of one checks it where present, and the loader's fallback where absent. Run this file
# with LAKESHARD_NO_EXTENSIONS=1 too, for the fallback's side.
_rows = arrow_columns._rows
_jpeg = decode._jpeg


def jpeg(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 90, dtype=np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def in_arrow_buffer(data: bytes) -> memoryview:
    """A view into the middle of an Arrow buffer, as ShardLoader hands images to decoders."""
    values = pa.array([b"x" * 5, data], pa.binary()).buffers()[2]
    return memoryview(values).cast("B")[5:]


def in_fresh_process(code: str, dataset: Path, **env: str) -> str:
    """Run ``code`` (``sys.argv[1]`` is ``dataset``) in a new Python from the repository root,
    with ``env`` added to the environment; its stdout, after checking that it succeeded."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code, str(dataset)],
        cwd=root,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("name", sorted(decode.DECODERS))
def test_views_decode_like_bytes(name: str):
    data = jpeg(16, 12)
    fn = decode.get_decoder(name)
    expected = fn(data)
    out = np.empty((12, 16, 3), dtype=np.uint8)
    assert fn(in_arrow_buffer(data), out) is out
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("name", sorted(decode.DECODERS))
@pytest.mark.parametrize("size", [(8, 12), (32, 12), (16, 20)])
def test_wrong_size_is_refused_with_both_sizes(name: str, size: tuple[int, int]):
    out = np.empty((12, 16, 3), dtype=np.uint8)
    with pytest.raises(decode.ImageSizeError, match=rf"image is {size[0]}x{size[1]}, expected 16x12"):
        decode.get_decoder(name)(in_arrow_buffer(jpeg(*size)), out)


def test_wrong_size_and_null_rows_name_the_row(tmp_path: Path):
    write_dataset(tmp_path, rows={"train": 8, "validation": 4, "test": 4}, num_shards=1, fmt="jpeg")
    path = shard_path(tmp_path, "train", 0, 1)
    table = pq.read_table(path)
    images = table.column("image").to_pylist()
    images[3], images[6] = jpeg(4, 4), None
    labels = table.column("label").to_pylist()
    labels[7] = None
    pads = [None, *table.column("is_pad").to_pylist()[1:]]  # a null is_pad: not a pad
    for name, values in (
        ("image", pa.array(images, pa.binary())),
        ("label", pa.array(labels, pa.int64())),
        ("is_pad", pa.array(pads)),
    ):
        table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table, path, row_group_size=5)

    # Each loader closed here, not left to the garbage collector: its threads end with the test.
    with (
        ShardLoader(str(tmp_path), batch_size=4, num_threads=1) as failing,  # one thread: row 3 fails first
        pytest.raises(
            LoaderError,
            match=r"cannot decode image at row 3 of .*part-00000-of-00001.parquet: ImageSizeError: image is 4x4, expected 8x8",
        ),
    ):
        list(failing)
    with ShardLoader(str(tmp_path), batch_size=4, skip_bad_rows=True) as loader:
        batches = list(loader)
    reasons = {s.row: s.reason for s in loader.skipped_rows}
    assert reasons == {
        3: "cannot decode image: image is 4x4, expected 8x8",
        6: "image is null",
        7: "label is null",
    }
    labels = torch.cat([lab for _, lab in batches]).tolist()
    assert [i for i, label in enumerate(labels) if label == PAD_LABEL] == [3, 6, 7]
    assert len(batches) == 2 and all(len(im) == 4 for im, _ in batches)
    assert ids_of(batches[0][0])[:3] != [0, 0, 0]  # the good rows still decode


@pytest.mark.parametrize("image_type", [pa.binary(), pa.large_binary(), pa.binary_view()], ids=str)
def test_shards_of_any_binary_type_load_alike(tmp_path: Path, image_type: pa.DataType):
    """The job writes ``binary``; another writer may use 64-bit offsets or views, with nulls:
    the loader reads them all alike."""
    write_dataset(tmp_path, rows={"train": 12, "validation": 4, "test": 4}, num_shards=1, fmt="jpeg")
    path = shard_path(tmp_path, "train", 0, 1)
    expected_ids = [i for images, _ in ShardLoader(str(tmp_path), batch_size=4) for i in ids_of(images)]
    table = pq.read_table(path)
    images = table.column("image").to_pylist()
    images[5] = None
    column = pa.array(images, image_type)
    table = table.set_column(table.schema.get_field_index("image"), pa.field("image", image_type), column)
    pq.write_table(table, path, row_group_size=5, store_schema=True)
    assert pq.read_schema(path).field("image").type == image_type
    loader = ShardLoader(str(tmp_path), batch_size=4, skip_bad_rows=True)
    got_ids = [i for images, _ in loader for i in ids_of(images)]
    assert [(s.row, s.reason) for s in loader.skipped_rows] == [(5, "image is null")]
    assert got_ids[5] == 0  # the null row: an all-zero image
    assert got_ids[:5] + got_ids[6:] == expected_ids[:5] + expected_ids[6:]


@pytest.mark.parametrize("type_", [pa.bool_(), pa.int64(), pa.int32(), pa.int8()], ids=str)
def test_label_and_pad_columns_read_from_their_buffers_match_arrow(type_: pa.DataType):
    """Sliced (as a piece that starts inside a row group is), one chunk or two, with and without
    nulls: the same values as Arrow's own conversion."""
    if type_ == pa.bool_():
        raw = [True, False, None, True, True, False, True, None, False, True, True]
    else:
        raw = [3, -1, None, 7, 0, 127, 5, None, 1, 9, 4]
    for values in (raw, [v for v in raw if v is not None]):
        one_chunk = pa.chunked_array([pa.array(values, type_)]).slice(3, 5)
        two_chunks = pa.chunked_array([pa.array(values[:6], type_), pa.array(values[6:], type_)]).slice(
            3, len(values) - 4
        )
        for column in (one_chunk, two_chunks):
            want = [-7 if v is None else int(v) for v in column.to_pylist()]
            got = _int64s(column, null=-7)
            assert got.dtype == np.int64 and got.tolist() == want


def test_the_row_copier_is_used_when_built():
    """pip builds ``loaders/_rows.c`` where it can; without it (or with LAKESHARD_NO_EXTENSIONS)
    the loader copies rows out with ``to_pylist`` and says so: ``extension`` returned ``None``
    and recorded why."""
    if _rows is not None:
        assert _rows.rows.__doc__.startswith("rows(offsets, values, offset, length, validity)")
        assert "_rows" not in extensions._missing
    else:
        why, lost = extensions._missing["_rows"]
        assert why in ("is not built", "is switched off (LAKESHARD_NO_EXTENSIONS is set)")
        assert "to_pylist()" in lost


@pytest.mark.parametrize("type_", [pa.binary(), pa.large_binary()], ids=str)
def test_image_rows_copied_without_the_gil_match_arrow(type_: pa.DataType):
    values = [b"\xff\xd8" + bytes([i]) * (i * 997 % 5000) for i in range(40)]
    values[3] = values[17] = None
    values[5] = b""
    full = pa.chunked_array([pa.array(values, type_)])
    cases = {  # each column, and the rows written into it
        "one chunk": (full, values),
        "a slice": (full.slice(3, 30), values[3:33]),
        "two chunks, sliced": (
            pa.chunked_array([pa.array(values[:11], type_), pa.array(values[11:], type_)]).slice(2, 33),
            values[2:35],
        ),
        "no nulls": (pa.chunked_array([pa.array(values[18:], type_)]), values[18:]),
        "empty": (full.slice(40), []),
        "all null": (pa.chunked_array([pa.array([None, None], type_)]), [None, None]),
    }
    for name, (column, written) in cases.items():
        got = _binary_rows(column)
        assert got == written, name
        assert all(type(x) is bytes for x in got if x is not None), name


@pytest.mark.slow  # a fresh python imports torch
def test_without_the_extension_the_loader_yields_the_same_batches(tmp_path: Path):
    """``LAKESHARD_NO_EXTENSIONS=1`` (or an install without a C compiler) falls back to Arrow's
    ``to_pylist`` and to simplejpeg image by image: the same batches, each way in a fresh process."""
    write_dataset(tmp_path, rows={"train": 30, "validation": 4, "test": 4}, num_shards=2, fmt="jpeg")
    code = (
        "import hashlib, sys\n"
        "from loaders import ShardLoader, decode\n"
        "from loaders._internal import arrow_columns\n"
        "digest = hashlib.sha256()\n"
        "for images, labels in ShardLoader(sys.argv[1], batch_size=4, shuffle=True, seed=3):\n"
        "    digest.update(images.numpy().tobytes()); digest.update(labels.numpy().tobytes())\n"
        "print(arrow_columns._rows is not None, decode._jpeg is not None, digest.hexdigest())\n"
    )
    seen = {off: in_fresh_process(code, tmp_path, LAKESHARD_NO_EXTENSIONS=off).split() for off in ("", "1")}
    built = [str(importlib.util.find_spec(f"loaders.{name}") is not None) for name in ("_rows", "_jpeg")]
    assert seen[""][:2] == built and seen["1"][:2] == ["False", "False"]
    assert seen[""][2] == seen["1"][2]


def test_a_missing_extension_is_a_warning_once_when_a_loader_falls_back(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.DEBUG, logger="loaders._internal.extensions"):
        assert extensions.extension("_no_such_extension", "rows are counted by hand (slower)") is None
        assert caplog.records == []  # nothing yet: only falling back is announced
        extensions.fall_back("_no_such_extension")
        extensions.fall_back("_no_such_extension")
    why = (
        "is switched off (LAKESHARD_NO_EXTENSIONS is set)"
        if os.environ.get("LAKESHARD_NO_EXTENSIONS")
        else "is not built"
    )
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            f"loaders._no_such_extension {why}: rows are counted by hand (slower); see docs/performance.md",
        )
    ]


@pytest.mark.slow  # a fresh python imports torch
def test_a_loader_without_its_extensions_warns_once_per_process_not_at_import(tmp_path: Path):
    """Before, ``import loaders`` logged at INFO, before logging was set up: nobody saw it."""
    write_dataset(tmp_path, rows={"train": 12, "validation": 4, "test": 4}, num_shards=2, fmt="jpeg")
    code = (
        "import json, logging, sys\n"
        "seen = []\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record): seen.append([record.name, record.levelname, record.getMessage()])\n"
        "logging.getLogger().addHandler(Keep()); logging.getLogger().setLevel(logging.DEBUG)\n"
        "from loaders import ShardLoader\n"
        "at_import = list(seen)\n"
        "for _ in range(2):  # two loaders, two epochs each\n"
        "    loader = ShardLoader(sys.argv[1], batch_size=4)\n"
        "    for e in range(2):\n"
        "        loader.set_epoch(e); rows = sum(len(labels) for _, labels in loader)\n"
        "print(json.dumps([at_import, [r for r in seen if r[0] == 'loaders._internal.extensions' or r[1] == 'WARNING']]))\n"
    )
    at_import, warnings = json.loads(in_fresh_process(code, tmp_path, LAKESHARD_NO_EXTENSIONS="1"))
    assert at_import == []
    off = "is switched off (LAKESHARD_NO_EXTENSIONS is set)"
    assert sorted(warnings) == [
        [
            "loaders._internal.extensions",
            "WARNING",
            f"loaders._jpeg {off}: JPEGs are decoded image by image with simplejpeg (slower); see docs/performance.md",
        ],
        [
            "loaders._internal.extensions",
            "WARNING",
            f"loaders._rows {off}: images are copied out of Arrow with to_pylist(), which holds the GIL (slower); see docs/performance.md",
        ],
    ]


def test_the_row_copier_refuses_buffers_that_do_not_hold_the_rows():
    """The extension checks the buffers it is handed. Without it the loader hands ``to_pylist``
    Arrow arrays, and Arrow refuses to make one of the same buffers."""
    validity, offsets, values = pa.array([b"abc", b"de"], pa.binary()).buffers()
    int32s = lambda *xs: pa.py_buffer(np.array(xs, dtype=np.int32).tobytes())  # noqa: E731
    cases = [
        (offsets, 3, validity, "buffers too short for 3 rows at offset 0"),
        (int32s(0, 3, 9), 2, None, "outside the 5-byte values buffer"),  # row 1 ends past the 5 bytes
        (int32s(0, 4, 2), 2, None, "row 1 has a negative length"),
        # Rows 0 and 2 are null: only row 1's own offsets (9 to 12) show that it leaves the buffer.
        (
            int32s(0, 9, 12, 2),
            3,
            pa.py_buffer(bytes([0b010])),
            "row 1 points outside the 5-byte values buffer",
        ),
    ]
    for offs, length, bits, message in cases:
        if _rows is not None:
            with pytest.raises(ValueError, match=message):
                _rows.rows(offs, values, 0, length, bits)
        else:
            with pytest.raises((pa.ArrowInvalid, ValueError)):
                pa.Array.from_buffers(pa.binary(), length, [bits, offs, values]).validate(full=True)


@pytest.mark.slow  # a fresh python imports torch
def test_a_fresh_process_loads_without_importing_pandas_or_arrow_compute(tmp_path: Path):
    """Arrow's ``to_numpy`` imports pandas on first use (0.4 s), and ``cast`` imports
    ``pyarrow.compute`` (~0.1 s): both on the reader thread, before a fresh process's first
    batch. The loader reads its columns without them."""
    write_dataset(tmp_path, rows={"train": 12, "validation": 4, "test": 4}, num_shards=2, fmt="jpeg")
    code = (
        "import sys\n"
        "from loaders import ShardLoader\n"
        "loader = ShardLoader(sys.argv[1], batch_size=4, shuffle=True)\n"
        "rows = sum(len(labels) for _, labels in loader)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'pandas' or m == 'pyarrow.compute')\n"
        "print(rows, heavy[:3])\n"
    )
    assert in_fresh_process(code, tmp_path).split(None, 1) == ["12", "[]\n"]


def encoded(array: np.ndarray, fmt: str = "JPEG", mode: str | None = None, **options) -> bytes:
    buf = io.BytesIO()
    image = Image.fromarray(array)
    (image.convert(mode) if mode else image).save(buf, format=fmt, **options)
    return buf.getvalue()


def first_pass(rows: list, out: np.ndarray) -> list[int]:
    """What ``auto`` decodes first, as the loader calls it: the whole batch with ``loaders._jpeg``
    where present (the rows it left), or nothing (every row is left to the image decoder)."""
    batch = decode.get_batch_decoder("auto")
    return batch(rows, out) if batch is not None else list(range(len(rows)))


def test_the_batch_jpeg_decoder_is_used_when_built():
    """pip builds ``loaders/_jpeg.c`` where it finds libjpeg's headers; without it (or with
    LAKESHARD_NO_EXTENSIONS) ``auto`` has no batch decoder and decodes image by image."""
    if _jpeg is not None:
        assert _jpeg.decode_into.__doc__.startswith("decode_into(images, out, height, width)")
        assert decode.get_batch_decoder("auto") is not None
    else:
        assert decode.get_batch_decoder("auto") is None
        assert extensions._missing["_jpeg"][1] == "JPEGs are decoded image by image with simplejpeg (slower)"
    assert decode.get_batch_decoder("pillow") is None and decode.get_batch_decoder("simplejpeg") is None
    with pytest.raises(ValueError, match="decoder must be one of"):
        decode.get_batch_decoder("turbo")


def test_the_batch_jpeg_decoder_gives_simplejpegs_pixels():
    """Chroma subsampling 4:4:4, 4:2:2 and 4:2:0, grayscale, progressive, optimised Huffman
    tables, restart markers, from bytes and from views into an Arrow buffer: pixel for pixel
    what simplejpeg decodes, and every row decoded."""
    import simplejpeg

    rng = np.random.default_rng(5)
    smooth = np.asarray(
        Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).resize((40, 24), Image.BILINEAR)
    )
    noisy = rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)
    images = [
        encoded(smooth, quality=95, subsampling=0),
        encoded(noisy, quality=80, subsampling=1),
        encoded(noisy, quality=60, subsampling=2),
        encoded(noisy, mode="L", quality=90),
        encoded(smooth, progressive=True, quality=85),
        encoded(noisy, optimize=True, quality=75),
        encoded(noisy, quality=90, restart_marker_blocks=1),
    ]
    rows = [*images, *map(in_arrow_buffer, images)]
    out = np.full((len(rows), 24, 40, 3), 7, dtype=np.uint8)
    left = first_pass(rows, out)
    assert left == ([] if _jpeg is not None else list(range(len(rows))))
    for i in left:
        decode.get_decoder("auto")(rows[i], out[i])
    want = np.stack([simplejpeg.decode_jpeg(data, colorspace="RGB") for data in images])
    assert np.array_equal(out[: len(images)], want)
    assert np.array_equal(out[len(images) :], want)


def test_the_batch_jpeg_decoder_leaves_what_it_cannot_decode_to_the_image_decoder():
    rng = np.random.default_rng(6)
    pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    good = encoded(pixels, quality=90)
    rows = [
        good,
        None,
        b"",
        good[: len(good) // 2],  # truncated: libjpeg warns and pads; left, not padded silently
        b"\xff\xd8\xff not a jpeg after all",
        encoded(pixels, fmt="PNG"),
        encoded(pixels, mode="CMYK", quality=90),
        jpeg(8, 16),  # the wrong size
        in_arrow_buffer(good),
    ]
    out = np.zeros((len(rows), 16, 16, 3), dtype=np.uint8)
    left = first_pass(rows, out)
    assert left == ([1, 2, 3, 4, 5, 6, 7] if _jpeg is not None else list(range(len(rows))))
    auto = decode.get_decoder("auto")
    for i in {0, 8}.intersection(left):  # without the extension, the good rows too
        auto(rows[i], out[i])
    assert np.array_equal(out[0], decode.decode_simplejpeg(good)) and np.array_equal(out[8], out[0])
    # What the loader then does with them: the PNG decodes with Pillow, the CMYK JPEG with
    # simplejpeg's own conversion (libjpeg has none to RGB); the rest are refused.
    assert np.array_equal(auto(rows[5], out[5]), pixels)
    assert np.abs(auto(rows[6], out[6]).astype(int) - decode.decode_pillow(rows[6])).max() <= 2
    for i in (2, 3, 4):
        with pytest.raises((ValueError, OSError)):  # simplejpeg's or Pillow's refusal
            auto(rows[i], out[i])
    with pytest.raises(decode.ImageSizeError, match="image is 8x16, expected 16x16"):
        auto(rows[7], out[7])


def test_the_batch_jpeg_decoder_refuses_an_output_that_does_not_fit():
    """Without the extension, the image decoder refuses what does not fit, row by row, and
    writes into an output simplejpeg cannot."""
    good = jpeg(8, 8)
    if _jpeg is None:
        auto = decode.get_decoder("auto")
        with pytest.raises(decode.ImageSizeError, match="image is 8x8, expected 16x8"):
            auto(good, np.empty((8, 16, 3), dtype=np.uint8))
        view = np.empty((8, 8, 3), dtype=np.uint8)[::-1, ::-1]  # simplejpeg cannot write to it: Pillow does
        assert np.array_equal(auto(good, view), decode.decode_pillow(good))
        with pytest.raises(TypeError):
            auto(5, np.empty((8, 8, 3), dtype=np.uint8))
        return
    with pytest.raises(ValueError, match="out has 192 bytes, 2 images of 8x8x3 need 384"):
        _jpeg.decode_into([good, good], np.empty((1, 8, 8, 3), dtype=np.uint8), 8, 8)
    with pytest.raises(ValueError, match="image size 0x8 is out of range"):
        _jpeg.decode_into([good], np.empty((1, 8, 8, 3), dtype=np.uint8), 8, 0)
    with pytest.raises(ValueError, match="not C-contiguous"):
        _jpeg.decode_into([good], np.empty((1, 16, 8, 3), dtype=np.uint8)[:, ::2], 8, 8)  # not contiguous
    with pytest.raises(BufferError, match="not writable"):
        _jpeg.decode_into([good], b"\0" * 192, 8, 8)
    with pytest.raises(TypeError, match="a bytes-like object is required, not 'int'"):
        _jpeg.decode_into([good, 5], np.empty((2, 8, 8, 3), dtype=np.uint8), 8, 8)


def test_a_batch_with_bad_rows_reports_them_in_row_order(tmp_path: Path):
    """The batch decoder goes first, then the rows it left and the rows with a bad label are
    visited in row order: with one thread, the first bad row fails the loader; skipped, every
    bad row is reported once and the rest of the batch is intact."""
    write_dataset(tmp_path, rows={"train": 8, "validation": 4, "test": 4}, num_shards=1, fmt="jpeg")
    path = shard_path(tmp_path, "train", 0, 1)
    expected = [i for images, _ in ShardLoader(str(tmp_path), batch_size=8) for i in ids_of(images)]
    table = pq.read_table(path)
    images = table.column("image").to_pylist()
    cmyk = encoded(np.asarray(Image.open(io.BytesIO(images[4])).convert("RGB")), mode="CMYK", quality=95)
    images[1], images[4], images[6] = images[1][:40], cmyk, b"\xff\xd8\xffjunk"
    labels = table.column("label").to_pylist()
    labels[2] = 99
    for name, values in (("image", pa.array(images, pa.binary())), ("label", pa.array(labels, pa.int64()))):
        table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table, path)

    with pytest.raises(LoaderError, match=r"cannot decode image at row 1 of .*part-00000-of-00001.parquet"):
        list(ShardLoader(str(tmp_path), batch_size=8, num_threads=1))
    loader = ShardLoader(str(tmp_path), batch_size=8, skip_bad_rows=True)
    ((batch, got_labels),) = list(loader)
    assert [s.row for s in loader.skipped_rows] == [1, 2, 6]
    assert loader.skipped_rows[1].reason == "label 99 out of range [0, 3)"
    assert all(s.reason.startswith("cannot decode image") for s in loader.skipped_rows[::2])
    got = ids_of(batch)
    assert [got[i] for i in (0, 3, 5, 7)] == [expected[i] for i in (0, 3, 5, 7)]
    row4 = batch[4].permute(1, 2, 0).numpy().astype(int)  # the CMYK row: decoded by the fallback
    assert np.abs(row4 - decode.decode_pillow(cmyk)).max() <= 2
    assert [got[i] for i in (1, 2, 6)] == [0, 0, 0]
    assert [i for i, label in enumerate(got_labels.tolist()) if label == PAD_LABEL] == [1, 2, 6]
