#!/usr/bin/env bash
# Set up and run every test, slow ones included: the main environment (.venv), Chromium for the
# report test, the separate petastorm environment (.venv-petastorm: petastorm needs
# pyarrow 14 and numpy < 2, which cannot share .venv) for the petastorm interop tests and the
# peer benchmark's petastorm tool, and the peers' environments (.venv-peers/<tool>) for the
# peer benchmark's test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_test_extras.sh # apt-get's, one at a time: first
# The side environments install while the main one does (each waits mostly on the package index);
# each one's lines are printed when it ends.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
side=(setup_petastorm setup_peers)
pids=()
for s in "${side[@]}"; do
    bash "scripts/$s.sh" >"$logs/$s" 2>&1 &
    pids+=($!)
done
bash scripts/setup.sh
failed=0
for i in "${!side[@]}"; do
    wait "${pids[$i]}" || { echo "test.sh: scripts/${side[$i]}.sh failed:" >&2; failed=1; }
    cat "$logs/${side[$i]}"
done
[ "$failed" = 0 ] || exit 1
echo "test.sh: set up in ${SECONDS} s"
source .venv/bin/activate
export SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$PWD/.venv/bin/python"
# The linter and the formatter first: a tree that is not formatted fails in seconds, not after the tests.
ruff check .
ruff format --check .
# The type checker over lakeshard/, jobs/ and loaders/ (pyproject.toml [tool.mypy]).
mypy
# Three workers (pytest-xdist), a test file to each at a time (its module fixtures start once): many
# tests wait on processes they start (Spark, Dask, torchrun, servers), so on 2 cores a third worker
# fills the waits (the whole pytest run 1,370 s with two, 1,114 s with three; README, Development).
# LAKESHARD_TEST_WORKERS=N for another count, 1: one process, a test at a time.
workers=${LAKESHARD_TEST_WORKERS:-3}
if [ "$workers" = 1 ]; then dist=(); else dist=(-n "$workers" --dist loadfile); fi
# --durations: the slowest tests, named in the log, so a run that grows toward CI's limit says where.
python -m pytest "${dist[@]}" --durations=25 --ignore=tests/petastorm "$@"
# The decode tests again with the C extensions switched off: the fallback CI would not otherwise see.
LAKESHARD_NO_EXTENSIONS=1 python -m pytest tests/loaders/test_decode.py -q -p no:cacheprovider
.venv-petastorm/bin/python -m pytest tests/petastorm -p no:cacheprovider
echo "test.sh: everything passed in ${SECONDS} s"
