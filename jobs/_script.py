"""Imported first by a job run as a script (``spark-submit jobs/shard.py``), where Python puts
``jobs/`` first on ``sys.path``: put the repository root there instead, so ``import jobs``
finds the package and no module of it is imported as a top-level sibling."""

import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
