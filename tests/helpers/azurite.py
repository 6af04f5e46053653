"""Azurite's blob service on 127.0.0.1 for the ``az://`` tests (``benchmarks/emulated_store.py``
starts it; scripts/setup_azurite.sh installs it): the session fixture ``azurite`` in
tests/conftest.py starts it and stops it after. The account is Azurite's well-known
``devstoreaccount1`` (its key is public, in Azurite's documentation): tests only."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from emulated_store import (
    ACCOUNT,
    ACCOUNT_KEY,
    Azurite,
    AzuriteMissingError,
    connection_string,
    find_azurite,
    installed_azurite,
)

__all__ = [
    "ACCOUNT",
    "ACCOUNT_KEY",
    "Azurite",
    "blob_reads",
    "connection_string",
    "require_azurite",
    "require_old_azurite",
]

#: Azurite 3.35.0, which ignores List Blobs' ``startFrom`` (scripts/setup_azurite.sh installs it).
OLD_AZURITE = installed_azurite("azurite-3.35.0")


_REQUEST = re.compile(
    r"RequestMethod=GET RequestURL=http://[^/\s]+/[^/\s]+/(?P<container>[^/?\s]+)/(?P<blob>[^?\s]+) "
    r"RequestHeaders:(?P<headers>\{.*?\}) ClientIP="
)


def blob_reads(server: Azurite, container: str) -> list[tuple[str, str | None]]:
    """The blob GETs (downloads, whole or a range) of ``container`` that ``server`` was sent, in
    order, by its debug log: the blob and the range asked (``x-ms-range`` or ``Range``; None:
    the whole blob)."""
    out = []
    for m in _REQUEST.finditer(server.served_log()):
        if unquote(m["container"]) == container:
            headers = json.loads(m["headers"])
            out.append((unquote(m["blob"]), headers.get("x-ms-range") or headers.get("range")))
    return out


def require_azurite() -> str:
    """The ``azurite-blob`` command: a missing one fails the test naming the setup script (never
    a skip)."""
    try:
        return find_azurite()
    except AzuriteMissingError as exc:
        pytest.fail(str(exc))


def require_old_azurite() -> str:
    """Azurite 3.35.0's ``azurite-blob`` (an endpoint without ``startFrom``): a missing one fails
    the test naming the setup script."""
    if not OLD_AZURITE.exists():
        pytest.fail(f"{OLD_AZURITE} is missing: run bash scripts/setup_azurite.sh")
    return str(OLD_AZURITE)
