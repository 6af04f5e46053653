#!/usr/bin/env bash
# A second virtualenv, .venv-petastorm, for petastorm (tests/petastorm, and the petastorm tool of
# benchmarks/peers/: reading our shards, and writing its own with materialize_dataset on Spark).
# petastorm 0.12.1 needs an old stack that cannot share .venv: pyarrow 14.0.2, numpy < 2,
# pandas 2.2.x. (petastorm 0.13.1 drops rows in its thread pool: not used.)
#
# torch==2.13.0 comes first (any other torch requirement pulls GBs of CUDA packages): the one the
# peers' environments share (scripts/torch_layer.sh), then the pins, then petastorm itself with
# --no-deps. pyspark (materialize_dataset runs on a Spark session) is 4.0.5, the newest whose
# SQL requirements this stack meets: petastorm asks only pyspark>=2.1, and from 4.1 pyspark's
# sql extra wants pyarrow>=15. Finally this project with --no-deps, so jobs/ and loaders/
# import (without dask: the petastorm side reads shards and writes its own, never runs our jobs).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-petastorm
PY=${PYTHON:-python3}
source scripts/torch_layer.sh # TORCH, torch_layer
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip() {  # quiet unless it fails
    local out
    out=$("$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "$@" 2>&1) || { echo "$out" >&2; return 1; }
}
stamp=$VENV/.lakeshard-petastorm-installed
if [ ! -f "$stamp" ] || [ "$0" -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/torch_layer.sh -nt "$stamp" ]; then
    echo "torch==$TORCH" >"$VENV/constraints.txt"
    torch_layer "$VENV"
    pip "numpy>=1.26,<2" "pyarrow==14.0.2" "pandas>=2.2,<2.3" \
        "pillow>=10.3,<14" "simplejpeg>=1.7,<2" "fsspec>=2024.6" "pyyaml>=6,<7" "tqdm>=4.66,<5" \
        "dill>=0.2.1" "diskcache>=3.0.0" "future>=0.10.2" "packaging>=15.0" "psutil>=4.0.0" \
        "pyzmq>=14.0.0" "six>=1.5.0" "pyspark==4.0.5" "pytest>=8,<10" "pytest-timeout>=2.3" "ruff>=0.6"
    pip --no-deps "petastorm==0.12.1"
    pip --no-deps -e .
    "$VENV/bin/python" - <<'PY'
import numpy, pyarrow, pandas, simplejpeg, torch, petastorm, petastorm.pytorch, pyspark
import petastorm.etl.dataset_metadata  # noqa: F401 (materialize_dataset: imports pyspark)
import lakeshard.format, loaders, loaders.petastorm_compat  # noqa: F401
assert pyarrow.__version__ == "14.0.2", pyarrow.__version__
assert numpy.__version__.startswith("1."), numpy.__version__
assert petastorm.__version__ == "0.12.1", petastorm.__version__
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert pyspark.__version__ == "4.0.5", pyspark.__version__
PY
    touch "$stamp"
fi
echo "setup: $VENV ready ($("$VENV/bin/python" -c 'import petastorm, pyspark, pyarrow, numpy, pandas, torch; print("petastorm", petastorm.__version__, "pyspark", pyspark.__version__, "pyarrow", pyarrow.__version__, "numpy", numpy.__version__, "pandas", pandas.__version__, "torch", torch.__version__)'))"
