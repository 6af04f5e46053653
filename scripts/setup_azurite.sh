#!/usr/bin/env bash
# Azurite (the npm package `azurite`, Microsoft's Azure Storage emulator), for the az:// tests:
# tests/conftest.py starts its blob service (azurite-blob) on 127.0.0.1. Installed with npm into
# .tools/azurite of this checkout (no global install, no root needed); Node.js >= 18 must be on
# PATH. Idempotent: a second run only checks.
#
# Two versions: 3.37.0, the tests' Azure (List Blobs' startFrom, with which the manifest job cuts
# a large class prefix into tasks), and 3.35.0 in .tools/azurite-3.35.0, an endpoint that ignores
# startFrom, for the test that the listing then stops with an error instead of repeating keys.
set -euo pipefail
cd "$(dirname "$0")/.."
install() { # version folder
    local version=$1 dest=$2
    local bin="$dest/node_modules/.bin/azurite-blob"
    if [ ! -x "$bin" ] || ! grep -q "\"version\": \"$version\"" "$dest/node_modules/azurite/package.json" 2>/dev/null; then
        if ! command -v npm >/dev/null 2>&1; then
            echo "setup: npm not found: install Node.js (>= 18) for the Azure tests (Azurite)" >&2
            exit 1
        fi
        echo "setup: installing azurite $version into $dest" >&2
        mkdir -p "$dest"
        npm install --prefix "$dest" --no-audit --no-fund --loglevel=error "azurite@$version" >/dev/null
    fi
    echo "setup: azurite $("$bin" --version 2>/dev/null || echo 'not runnable') in $dest"
}
install 3.37.0 .tools/azurite &
main=$!
install 3.35.0 .tools/azurite-3.35.0
wait $main
