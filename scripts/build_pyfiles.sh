#!/usr/bin/env bash
# Build the zip that `spark-submit --py-files` ships to the executors: the `lakeshard` core and the
# `jobs` package (the engine-free steps and the Spark engine; `loaders` runs on the training nodes).
#
#   scripts/build_pyfiles.sh                      # -> dist/lakeshard-pyfiles.zip
#   scripts/build_pyfiles.sh /tmp/pyfiles.zip     # -> /tmp/pyfiles.zip
#   spark-submit --master spark://host:7077 --py-files dist/lakeshard-pyfiles.zip jobs/manifest.py ...
#
# The executors still need the third-party dependencies (pyarrow, pillow, fsspec, s3fs, numpy,
# pyyaml) in their Python: install `pip install lakeshard` (or the requirements) in the cluster
# image, or ship a packed venv with `--archives`. The zip carries only our code, so it can be
# rebuilt on every submit without touching the cluster.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/dist/lakeshard-pyfiles.zip}"
python="${PYTHON:-python3}"
[[ -x "$root/.venv/bin/python" && -z "${PYTHON:-}" ]] && python="$root/.venv/bin/python"

mkdir -p "$(dirname "$out")"
# zipfile, not zip(1): sorted entries and a fixed timestamp make the archive reproducible.
"$python" - "$root" "$out" <<'PY'
import os, sys, zipfile

root, out = sys.argv[1], os.path.abspath(sys.argv[2])
tmp = out + ".tmp"
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
    for package in ("lakeshard", "jobs"):
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    info = zipfile.ZipInfo(os.path.relpath(path, root), date_time=(1980, 1, 1, 0, 0, 0))
                    info.compress_type = zipfile.ZIP_DEFLATED
                    with open(path, "rb") as f:
                        zf.writestr(info, f.read())
os.replace(tmp, out)
print(out)
PY
