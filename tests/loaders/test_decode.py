"""Decoders read zero-copy views as well as bytes, and refuse an image of the wrong size."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loader_builders import ids_of, write_dataset
from PIL import Image

from jobs.errors import LoaderError
from loaders import ShardLoader, decode


def jpeg(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 90, dtype=np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def in_arrow_buffer(data: bytes) -> memoryview:
    """A view into the middle of an Arrow buffer, as ShardLoader hands images to decoders."""
    values = pa.array([b"x" * 5, data], pa.binary()).buffers()[2]
    return memoryview(values).cast("B")[5:]


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
    table = table.set_column(table.schema.get_field_index("image"), "image", pa.array(images, pa.binary()))
    pq.write_table(table, path, row_group_size=5)

    with pytest.raises(LoaderError, match=r"cannot decode image at row 3 of .*part-00000-of-00001.parquet: ImageSizeError: image is 4x4, expected 8x8"):
        list(ShardLoader(str(tmp_path), batch_size=4, num_threads=1))  # one thread: row 3 fails first
    loader = ShardLoader(str(tmp_path), batch_size=4, skip_bad_rows=True)
    batches = list(loader)
    reasons = {s.row: s.reason for s in loader.skipped_rows}
    assert reasons == {3: "cannot decode image: image is 4x4, expected 8x8", 6: "image is null"}
    assert len(batches) == 2 and all(len(im) == 4 for im, _ in batches)
    assert ids_of(batches[0][0])[:3] != [0, 0, 0]  # the good rows still decode
