"""One small hierarchy for every error the platform raises on purpose.

Each class also inherits the closest built-in, so callers that catch ``ValueError`` or
``OSError`` keep working (as pyarrow's ``ArrowInvalid(ValueError)`` does).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DatasetError",
    "DatasetExistsError",
    "EngineError",
    "ImageRejected",
    "LoaderError",
    "ManifestError",
    "NoConditionalWrites",
    "PlatformError",
    "RejectFractionError",
    "ShardError",
    "SplitError",
    "StorageError",
]


class PlatformError(Exception):
    """Base class of every error raised on purpose by jobs and loaders."""


class ConfigError(PlatformError, ValueError):
    """A configuration value is missing, malformed or out of range (names the key and source).

    ``option``: the option it concerns, as the code names it (``"batch_size"``), where it
    concerns one: a command line names its flag from it, without reading the message.
    """

    def __init__(self, message: str = "", *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class StorageError(PlatformError, OSError):
    """A URI cannot be read or written (names the URI)."""


class NoConditionalWrites(StorageError):
    """The store refused a conditional write (``If-None-Match``, ``If-Match``): it has none."""


class ManifestError(PlatformError, ValueError):
    """The manifest job cannot build a usable manifest from the lake."""


class SplitError(ManifestError):
    """Some class has fewer than ``min_per_class`` objects in some channel."""


class RejectFractionError(PlatformError, ValueError):
    """More of the input was rejected than ``max_reject_fraction`` allows."""


class ShardError(PlatformError, ValueError):
    """The shard job cannot produce the requested shards."""


class DatasetError(PlatformError, ValueError):
    """A dataset is missing, incomplete, or not what a reader expected."""


class DatasetExistsError(PlatformError, FileExistsError):
    """A job would overwrite a complete output and ``--overwrite`` was not given."""


class EngineError(PlatformError, RuntimeError):
    """An engine cannot start or reach its workers (names the address or master)."""


class LoaderError(PlatformError, RuntimeError):
    """A loader thread failed; the message names the shard URI and row."""


class ImageRejected(PlatformError, ValueError):
    """One image cannot be used; ``reason`` is what goes into the rejects table."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
