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

import json
import sys
import time
from pathlib import Path

import torch  # noqa: F401  (imported before the clock starts, as a training script has it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loaders import ShardLoader


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    options = json.loads(argv[1]) if len(argv) == 2 else {}
    start = time.perf_counter()
    loader = ShardLoader(argv[0], **options)
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
