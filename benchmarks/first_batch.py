"""A new process's first batch, as a training script's comes: the time from ``ShardLoader(...)``
to its first batch in a process whose imports are done (``torch``, ``loaders``), so with every
client, connection and lazily imported module the loader needs still to make. Run by
``remote_bench.py`` (the ``process`` line); by hand:

```
python benchmarks/first_batch.py s3://bucket/dataset '{"channel": "train", "batch_size": 64}'
```

Prints one JSON line: ``{"first_batch_s": ..., "constructor_s": ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch  # noqa: F401  (imported before the clock starts, as a training script has it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loaders import ShardLoader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", help="the dataset URI (a local path, file:// or s3://)")
    p.add_argument("options", nargs="?", default="{}", help="ShardLoader keyword arguments as a JSON object")
    args = p.parse_args(argv)
    options = json.loads(args.options)
    start = time.perf_counter()
    loader = ShardLoader(args.dataset, **options)
    made = time.perf_counter()
    batches = iter(loader)
    try:
        next(batches)
        first = time.perf_counter() - start
    finally:
        batches.close()
        loader.close()
    print(json.dumps({"first_batch_s": first, "constructor_s": made - start}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
