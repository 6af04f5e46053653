#!/usr/bin/env bash
# Set up (as scripts/setup.sh) and run every test, slow ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .venv/bin/activate
export SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$PWD/.venv/bin/python"
python -m pytest "$@"
