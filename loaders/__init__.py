"""Stream per-rank Parquet shards into a data-parallel PyTorch training loop.

``ShardLoader`` is the public entry point; ``python -m loaders.train`` trains on a dataset.
"""

from loaders._internal.plan import num_batches, rank_segments, rows_per_rank
from loaders.batch import PAD_LABEL, EncodedBatch, SkippedRow
from loaders.mixed_loader import MixedLoader
from loaders.named_batch import Batch
from loaders.options import Cost, Decoding, LoaderOptions, Preparation, RemoteReads, default_threads
from loaders.shard_loader import STATE_FORMAT, ShardLoader

__all__ = [
    "PAD_LABEL",
    "STATE_FORMAT",
    "Batch",
    "Cost",
    "Decoding",
    "EncodedBatch",
    "LoaderOptions",
    "MixedLoader",
    "Preparation",
    "RemoteReads",
    "ShardLoader",
    "SkippedRow",
    "default_threads",
    "num_batches",
    "rank_segments",
    "rows_per_rank",
]
