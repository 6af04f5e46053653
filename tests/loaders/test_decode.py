"""Decoders read zero-copy views as well as bytes, and refuse an image of the wrong size."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from loader_builders import ids_of, write_dataset
from PIL import Image

from lakeshard.errors import LoaderError
from loaders import PAD_LABEL, ShardLoader, decode
from loaders.shard_loader import _binary_rows, _int64s


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
    out = subprocess.run([sys.executable, "-c", code, str(dataset)], cwd=root, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
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
    path = tmp_path / "shards/train/part-00000-of-00001.parquet"
    table = pq.read_table(path)
    images = table.column("image").to_pylist()
    images[3], images[6] = jpeg(4, 4), None
    labels = table.column("label").to_pylist()
    labels[7] = None
    pads = [None, *table.column("is_pad").to_pylist()[1:]]  # a null is_pad: not a pad
    for name, values in (("image", pa.array(images, pa.binary())), ("label", pa.array(labels, pa.int64())), ("is_pad", pa.array(pads))):
        table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table, path, row_group_size=5)

    with pytest.raises(LoaderError, match=r"cannot decode image at row 3 of .*part-00000-of-00001.parquet: ImageSizeError: image is 4x4, expected 8x8"):
        list(ShardLoader(str(tmp_path), batch_size=4, num_threads=1))  # one thread: row 3 fails first
    loader = ShardLoader(str(tmp_path), batch_size=4, skip_bad_rows=True)
    batches = list(loader)
    reasons = {s.row: s.reason for s in loader.skipped_rows}
    assert reasons == {3: "cannot decode image: image is 4x4, expected 8x8", 6: "image is null", 7: "label is null"}
    labels = torch.cat([lab for _, lab in batches]).tolist()
    assert [i for i, label in enumerate(labels) if label == PAD_LABEL] == [3, 6, 7]
    assert len(batches) == 2 and all(len(im) == 4 for im, _ in batches)
    assert ids_of(batches[0][0])[:3] != [0, 0, 0]  # the good rows still decode


@pytest.mark.parametrize("image_type", [pa.binary(), pa.large_binary(), pa.binary_view()], ids=str)
def test_shards_of_any_binary_type_load_alike(tmp_path: Path, image_type: pa.DataType):
    """The job writes ``binary``; another writer may use 64-bit offsets or views, with nulls:
    the loader reads them all alike."""
    write_dataset(tmp_path, rows={"train": 12, "validation": 4, "test": 4}, num_shards=1, fmt="jpeg")
    path = tmp_path / "shards/train/part-00000-of-00001.parquet"
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
        two_chunks = pa.chunked_array([pa.array(values[:6], type_), pa.array(values[6:], type_)]).slice(3, len(values) - 4)
        for column in (one_chunk, two_chunks):
            want = [-7 if v is None else int(v) for v in column.to_pylist()]
            got = _int64s(column, null=-7)
            assert got.dtype == np.int64 and got.tolist() == want


def test_the_row_copier_is_built():
    """pip builds ``loaders/_rows.c`` (optional, so an install without a compiler still works:
    the loader then uses ``to_pylist``). Here, where the tests run, it must have been built, or
    the tests below would check the fallback only."""
    from loaders import _rows

    assert _rows.rows.__doc__.startswith("rows(offsets, values, offset, length, validity)")


@pytest.mark.parametrize("type_", [pa.binary(), pa.large_binary()], ids=str)
def test_image_rows_copied_without_the_gil_match_arrow(type_: pa.DataType):
    values = [b"\xff\xd8" + bytes([i]) * (i * 997 % 5000) for i in range(40)]
    values[3] = values[17] = None
    values[5] = b""
    full = pa.chunked_array([pa.array(values, type_)])
    cases = {
        "one chunk": full,
        "a slice": full.slice(3, 30),
        "two chunks, sliced": pa.chunked_array([pa.array(values[:11], type_), pa.array(values[11:], type_)]).slice(2, 33),
        "no nulls": pa.chunked_array([pa.array(values[18:], type_)]),
        "empty": full.slice(40),
        "all null": pa.chunked_array([pa.array([None, None], type_)]),
    }
    for name, column in cases.items():
        got = _binary_rows(column)
        assert got == column.to_pylist(), name
        assert all(type(x) is bytes for x in got if x is not None), name


def test_without_the_extension_the_loader_yields_the_same_batches(tmp_path: Path):
    """``LAKESHARD_NO_EXTENSIONS=1`` (or an install without a C compiler) falls back to Arrow's
    ``to_pylist`` and to simplejpeg image by image: the same batches, each way in a fresh process."""
    write_dataset(tmp_path, rows={"train": 30, "validation": 4, "test": 4}, num_shards=2, fmt="jpeg")
    code = (
        "import hashlib, sys\n"
        "from loaders import ShardLoader, decode, shard_loader\n"
        "digest = hashlib.sha256()\n"
        "for images, labels in ShardLoader(sys.argv[1], batch_size=4, shuffle=True, seed=3):\n"
        "    digest.update(images.numpy().tobytes()); digest.update(labels.numpy().tobytes())\n"
        "print(shard_loader._rows is not None, decode._jpeg is not None, digest.hexdigest())\n"
    )
    seen = {off: in_fresh_process(code, tmp_path, LAKESHARD_NO_EXTENSIONS=off).split() for off in ("", "1")}
    assert seen[""][:2] == ["True", "True"] and seen["1"][:2] == ["False", "False"]
    assert seen[""][2] == seen["1"][2]


def test_the_row_copier_refuses_buffers_that_do_not_hold_the_rows():
    from loaders import _rows

    validity, offsets, values = pa.array([b"abc", b"de"], pa.binary()).buffers()
    with pytest.raises(ValueError, match="buffers too short for 3 rows at offset 0"):
        _rows.rows(offsets, values, 0, 3, validity)
    bad = pa.py_buffer(np.array([0, 3, 9], dtype=np.int32).tobytes())  # row 1 ends past the 5 bytes
    with pytest.raises(ValueError, match="outside the 5-byte values buffer"):
        _rows.rows(bad, values, 0, 2, None)
    backwards = pa.py_buffer(np.array([0, 4, 2], dtype=np.int32).tobytes())
    with pytest.raises(ValueError, match="row 1 has a negative length"):
        _rows.rows(backwards, values, 0, 2, None)


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


def test_the_batch_jpeg_decoder_is_built():
    """pip builds ``loaders/_jpeg.c`` against the system's libjpeg-turbo (optional: without it
    ``auto`` decodes image by image with simplejpeg); here it must have been built."""
    from loaders import _jpeg

    assert _jpeg.decode_into.__doc__.startswith("decode_into(images, out, height, width)")
    assert decode.get_batch_decoder("auto") is not None
    assert decode.get_batch_decoder("pillow") is None and decode.get_batch_decoder("simplejpeg") is None
    with pytest.raises(ValueError, match="decoder must be one of"):
        decode.get_batch_decoder("turbo")


def test_the_batch_jpeg_decoder_gives_simplejpegs_pixels():
    """Chroma subsampling 4:4:4, 4:2:2 and 4:2:0, grayscale, progressive, optimised Huffman
    tables, restart markers, from bytes and from views into an Arrow buffer: pixel for pixel
    what simplejpeg decodes, and every row decoded."""
    import simplejpeg

    rng = np.random.default_rng(5)
    smooth = np.asarray(Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).resize((40, 24), Image.BILINEAR))
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
    assert decode.get_batch_decoder("auto")(rows, out) == []
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
    assert decode.get_batch_decoder("auto")(rows, out) == [1, 2, 3, 4, 5, 6, 7]
    assert np.array_equal(out[0], decode.decode_simplejpeg(good)) and np.array_equal(out[8], out[0])
    # What the loader then does with them: the PNG decodes with Pillow, the CMYK JPEG with
    # simplejpeg's own conversion (libjpeg has none to RGB); the rest are refused.
    auto = decode.get_decoder("auto")
    assert np.array_equal(auto(rows[5], out[5]), pixels)
    assert np.abs(auto(rows[6], out[6]).astype(int) - decode.decode_pillow(rows[6])).max() <= 2
    for i in (2, 3, 4):
        with pytest.raises((ValueError, OSError)):  # simplejpeg's or Pillow's refusal
            auto(rows[i], out[i])
    with pytest.raises(decode.ImageSizeError, match="image is 8x16, expected 16x16"):
        auto(rows[7], out[7])


def test_the_batch_jpeg_decoder_refuses_an_output_that_does_not_fit():
    from loaders import _jpeg

    good = jpeg(8, 8)
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
    path = tmp_path / "shards/train/part-00000-of-00001.parquet"
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
    (batch, got_labels), = list(loader)
    assert [s.row for s in loader.skipped_rows] == [1, 2, 6]
    assert loader.skipped_rows[1].reason == "label 99 out of range [0, 3)"
    assert all(s.reason.startswith("cannot decode image") for s in loader.skipped_rows[::2])
    got = ids_of(batch)
    assert [got[i] for i in (0, 3, 5, 7)] == [expected[i] for i in (0, 3, 5, 7)]
    row4 = batch[4].permute(1, 2, 0).numpy().astype(int)  # the CMYK row: decoded by the fallback
    assert np.abs(row4 - decode.decode_pillow(cmyk)).max() <= 2
    assert [got[i] for i in (1, 2, 6)] == [0, 0, 0]
    assert [i for i, label in enumerate(got_labels.tolist()) if label == PAD_LABEL] == [1, 2, 6]
