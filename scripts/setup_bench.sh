#!/usr/bin/env bash
# System packages the benchmarks need beyond scripts/setup.sh: nginx (Debian's package), the
# static file server behind benchmarks/remote_store.py's remote-like object store (remote_bench.py
# and tests/benchmarks/test_remote_bench.py). Only the binary is used: the store writes its own
# config and runs its own nginx process, so the package's service is stopped if apt started one.
# Idempotent: a second run only checks. Needs root (CI images run as root); otherwise run it
# under sudo.
set -euo pipefail

if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    echo "setup: installing nginx for benchmarks/remote_store.py" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx >/dev/null
    # The package may start its own service on port 80; the benchmarks do not use it.
    if command -v service >/dev/null 2>&1; then service nginx stop >/dev/null 2>&1 || true; fi
fi
echo "setup: $( (/usr/sbin/nginx -v || nginx -v) 2>&1 || echo 'nginx not runnable')"
