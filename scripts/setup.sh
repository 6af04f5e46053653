#!/usr/bin/env bash
# Set up a fresh machine: Java for Spark (if missing), a virtualenv in .venv with the CPU build of
# torch first (any other torch requirement pulls GBs of CUDA packages), then this project with
# every extra. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

has_cc() { command -v "${CC:-cc}" >/dev/null 2>&1; }
has_jpeg_headers() {  # a compile test, with pkg-config's flags where it knows libjpeg (Homebrew, for one)
    printf '#include <stdio.h>\n#include <jpeglib.h>\nint main(void) { return 0; }\n' |
        "${CC:-cc}" $(pkg-config --cflags libjpeg 2>/dev/null) -x c -c -o /dev/null - 2>/dev/null
}

if ! command -v java >/dev/null 2>&1; then
    echo "setup: installing a Java runtime for Spark" >&2
    apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless >/dev/null
fi

# The loader's optional C extensions (loaders/_rows.c, loaders/_jpeg.c) need a C compiler and
# libjpeg's headers. On Debian, as root, install them (CI needs the extensions); elsewhere pip
# builds what it can and the loader falls back for the rest (reported below, never fatal).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -f /etc/debian_version ] &&
    ! { has_cc && has_jpeg_headers; }; then
    echo "setup: installing a C compiler and libjpeg-turbo's headers for the loader's extensions" >&2
    apt-get update -qq && apt-get install -y -qq gcc libjpeg62-turbo-dev >/dev/null ||
        echo "setup: could not install gcc and libjpeg62-turbo-dev; going on without them" >&2
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
    # Where pkg-config knows libjpeg, its flags (setuptools reads CFLAGS and LDFLAGS).
    CFLAGS="${CFLAGS:-} $(pkg-config --cflags libjpeg 2>/dev/null || true)" \
        LDFLAGS="${LDFLAGS:-} $(pkg-config --libs-only-L libjpeg 2>/dev/null || true)" pip -e ".[dev]"
    # pip skips an optional extension it cannot build: say which, why, and what the loader does instead.
    how="see: .venv/bin/python -m pip install -v -e ."
    if ! has_cc; then why="no C compiler"; elif ! has_jpeg_headers; then why="no libjpeg headers"; else why=$how; fi
    .venv/bin/python -c "import loaders._rows" 2>/dev/null ||
        echo "setup: loaders/_rows.c not built ($(has_cc && echo "$how" || echo "no C compiler")): images are copied out of Arrow with to_pylist(), holding the GIL (slower)" >&2
    .venv/bin/python -c "import loaders._jpeg" 2>/dev/null ||
        echo "setup: loaders/_jpeg.c not built ($why): JPEGs are decoded image by image with simplejpeg (slower)" >&2
    .venv/bin/python -c "import torch, pyspark, dask, jobs, loaders" && touch "$stamp"
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, pyspark; print("torch", torch.__version__, "pyspark", pyspark.__version__)'))"
