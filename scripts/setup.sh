#!/usr/bin/env bash
# Set up a fresh machine: Java for Spark (if missing), a virtualenv in .venv with the CPU build of
# torch first (any other torch requirement pulls GBs of CUDA packages), then this project with
# every extra. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v java >/dev/null 2>&1; then
    echo "setup: installing a Java runtime for Spark" >&2
    apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless >/dev/null
fi

# The loader's C extensions (loaders/_rows.c, loaders/_jpeg.c): a compiler and libjpeg-turbo's headers.
if ! command -v cc >/dev/null 2>&1 || [ ! -f /usr/include/jpeglib.h ]; then
    echo "setup: installing a C compiler and libjpeg-turbo's headers for the loader's extensions" >&2
    apt-get update -qq && apt-get install -y -qq gcc libjpeg62-turbo-dev >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip() {  # quiet unless it fails (setuptools warns on every build of the extension)
    local out
    out=$(.venv/bin/python -m pip install -q "$@" 2>&1) || { echo "$out" >&2; return 1; }
}
stamp=.venv/.lakeshard-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ -n "$(find loaders -name '*.c' -newer "$stamp")" ]; then
    pip --upgrade pip
    pip "torch==2.13.0"
    pip -e ".[dev]"
    # pip skips an optional extension when it cannot build it; here they must be built.
    for ext in _rows _jpeg; do
        .venv/bin/python -c "import loaders.$ext" 2>/dev/null || {
            echo "setup: loaders/$ext.c was not built (see: .venv/bin/python -m pip install -v -e .)" >&2
            exit 1
        }
    done
    .venv/bin/python -c "import torch, pyspark, dask, jobs, loaders" && touch "$stamp"
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, pyspark; print("torch", torch.__version__, "pyspark", pyspark.__version__)'))"
