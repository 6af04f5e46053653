#!/usr/bin/env bash
# System packages some tests need beyond scripts/setup.sh: headless Chromium, which
# tests/report opens report.html in (Debian's chromium package). Idempotent: a second run only
# checks. Needs root (CI images run as root); otherwise run it under sudo.
set -euo pipefail

if [ ! -x /usr/bin/chromium ]; then
    echo "setup: installing chromium for tests/report" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
echo "setup: $(/usr/bin/chromium --version 2>/dev/null || echo 'chromium not runnable')"
bash "$(dirname "$0")/setup_bench.sh"  # nginx, for benchmarks/remote_store.py and its tests
bash "$(dirname "$0")/setup_azurite.sh"  # Azurite (npm), the Azure emulator of the az:// tests
