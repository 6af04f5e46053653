"""petastorm (0.12.1, in ``.venv-petastorm``, ``scripts/setup_petastorm.sh``): a petastorm dataset
written by ``materialize_dataset`` around a Spark write (a ``Unischema`` of the image's bytes, in
petastorm's ``NdarrayCodec``, and the label), read by ``make_reader`` on its thread pool of
``workers`` (row groups shuffled, a new reader each epoch, ``num_epochs=1``, as its docs loop)
through ``petastorm.pytorch.DataLoader`` with a shuffling queue, decoding in a ``TransformSpec``
on the pool's threads: the docs' path for a store that ``materialize_dataset`` made
(``make_batch_reader`` is theirs for Parquet that petastorm did not write). Local only: petastorm
reads ``s3://`` through s3fs, which ``.venv-petastorm`` leaves out.

``build`` (the jobs benchmark): the raw lake's paths parallelized on a local Spark session of
``workers`` cores, each image read and prepared (``per_image.prepare``) in Spark's Python workers,
written inside ``materialize_dataset`` as its docs show.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from build_cli import lake_images
from peer_common import Built, JpegSet, Settings, as_batch, decode, main
from petastorm import TransformSpec, make_reader
from petastorm.codecs import NdarrayCodec, ScalarCodec
from petastorm.pytorch import DataLoader
from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row

HERE = Path(__file__).resolve().parent
#: Row groups of this size (petastorm's examples use 256 MB; smaller ones give the reader's
#: thread pool and its row-group shuffle something to share out on a benchmark-sized set).
ROW_GROUP_MB = 8
#: Rows the DataLoader's shuffling queue holds (WebDataset's buffer here is as many samples).
SHUFFLE_QUEUE = 1000


def _schema() -> Unischema:
    from pyspark.sql.types import LongType, StringType

    return Unischema(
        "Images",
        [
            UnischemaField("key", np.str_, (), ScalarCodec(StringType()), False),
            UnischemaField("label", np.int64, (), ScalarCodec(LongType()), False),
            # The encoded image as a uint8 array: ScalarCodec takes no bytes, and petastorm's
            # CompressedImageCodec would re-encode the pixels (with OpenCV).
            UnischemaField("image", np.uint8, (None,), NdarrayCodec(), False),
        ],
    )


def _spark(workers: int) -> Any:
    """A local Spark session on ``workers`` cores, its driver on loopback, no UI."""
    from pyspark.sql import SparkSession

    # Spark's Python workers run here, in petastorm's environment, whatever a caller's
    # PYSPARK_PYTHON names (a test run of the main environment sets it to its own).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    return (
        SparkSession.builder.master(f"local[{workers}]")
        .appName("peers-petastorm")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )


def _materialize(spark: Any, rows: Any, out: Path) -> None:
    """``rows`` (an RDD of dicts of the schema's fields) written as a petastorm dataset at ``out``."""
    from petastorm.etl.dataset_metadata import materialize_dataset  # imports pyspark

    schema = _schema()
    url = out.resolve().as_uri()
    with materialize_dataset(spark, url, schema, ROW_GROUP_MB):
        frame = spark.createDataFrame(
            rows.map(lambda row: dict_to_spark_row(schema, row)), schema.as_spark_schema()
        )
        frame.write.mode("overwrite").parquet(url)


def write(jpegs: Path, out: Path) -> None:
    images = JpegSet.read(jpegs)
    spark = _spark(os.cpu_count() or 1)
    try:
        rows = spark.sparkContext.parallelize(
            [{"key": path.name, "label": label, "image": str(path)} for path, label in images.images]
        ).map(lambda row: {**row, "image": np.frombuffer(Path(row["image"]).read_bytes(), dtype=np.uint8)})
        _materialize(spark, rows, out)
    finally:
        spark.stop()


# -- the jobs benchmark -----------------------------------------------------------------------------------
def _span(sc: Any) -> Any:
    """A Spark accumulator of ``(first, last)``: the ``time.time()`` an image's work finished."""
    from pyspark.accumulators import AccumulatorParam

    class Span(AccumulatorParam):
        def zero(self, value: tuple[float, float]) -> tuple[float, float]:
            return (float("inf"), float("-inf"))

        def addInPlace(self, a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
            return (min(a[0], b[0]), max(a[1], b[1]))

    return sc.accumulator((float("inf"), float("-inf")), Span())


def build(lake: Path, out: Path, *, size: int, quality: int, workers: int) -> Built:
    """The raw lake prepared and written as a petastorm dataset by Spark on ``workers`` cores."""
    jobs = [(str(path), path.relative_to(lake).as_posix(), label) for path, label in lake_images(lake)]
    spark = _spark(workers)
    try:
        sc = spark.sparkContext
        sc.addPyFile(str(HERE / "per_image.py"))  # Spark's Python workers import it from there
        span = _span(sc)

        def prepared(job: tuple[str, str, int]) -> dict[str, Any]:
            from per_image import prepare

            path, key, label = job
            image = prepare(Path(path).read_bytes(), size, quality)
            now = time.time()
            span.add((now, now))
            return {"key": key, "label": label, "image": np.frombuffer(image, dtype=np.uint8)}

        _materialize(spark, sc.parallelize(jobs, numSlices=workers * 2).map(prepared), out)
        first, last = span.value
    finally:
        spark.stop()
    images = sum(pq.read_metadata(p).num_rows for p in out.glob("*.parquet"))
    return {"images": images, "first_done": first if images else None, "last_done": last if images else None}


def stored(out: Path) -> Iterator[tuple[int, bytes]]:
    for path in sorted(out.glob("*.parquet")):
        table = pq.read_table(path, columns=["label", "image"])
        for label, image in zip(table.column("label").to_pylist(), table.column("image").to_pylist()):
            yield label, np.load(io.BytesIO(image)).tobytes()  # NdarrayCodec's encoding


# -- the loader ---------------------------------------------------------------------------------------
def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    return {"image": decode(row["image"].tobytes()), "label": row["label"]}


class Loader:
    def __init__(self, source: str, cache: Path | None, settings: Settings) -> None:
        if source.startswith("s3://"):
            raise ValueError(
                f"petastorm reads s3:// through s3fs, which .venv-petastorm leaves out: {source}"
            )
        self.url = Path(source).resolve().as_uri()
        self.settings = settings
        self.spec = TransformSpec(_decoded, edit_fields=[("image", np.uint8, (None, None, 3), False)])

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with make_reader(
            self.url,
            schema_fields=["image", "label"],
            reader_pool_type="thread",
            workers_count=self.settings.workers,
            seed=self.settings.seed + epoch,
            shuffle_row_groups=True,
            num_epochs=1,
            transform_spec=self.spec,
        ) as reader:
            loader = DataLoader(
                reader, batch_size=self.settings.batch_size, shuffling_queue_capacity=SHUFFLE_QUEUE
            )
            for batch in loader:
                yield as_batch(batch["image"], batch["label"])


if __name__ == "__main__":
    sys.exit(main(None, write=write, open_loader=Loader, build=build, stored=stored))
