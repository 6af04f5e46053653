"""``python -m loaders.train`` on a cluster whose ranks reach the store over different links:
rank ``r`` uses the S3 endpoint in ``LAKESHARD_TEST_ENDPOINT_<r>`` when it is set (the others the
usual ``AWS_ENDPOINT_URL``). Nothing of the trainer is changed; only each rank's environment, as a
node's own configuration would be.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.hardening.endpoint_per_rank ...
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    endpoint = os.environ.get(f"LAKESHARD_TEST_ENDPOINT_{os.environ.get('RANK', '0')}")
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    from loaders.train.loop import main

    sys.exit(main())
