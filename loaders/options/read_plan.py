"""What ``read_concurrency`` sets: the figures of a loader's remote reads, derived from it in one
place (:meth:`ReadPlan.of`), each with one meaning."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lakeshard.storage import CLIENT_CONNECTIONS

__all__ = ["ReadPlan"]

log = logging.getLogger(__name__)

#: The read concurrencies whose clamped parts were logged (one line a value and process).
_LOGGED: set[int] = set()


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """The figures of a loader's remote reads, from ``read_concurrency`` = ``c``.

    Attributes:
        in_flight: row-group reads in flight at once, in the order the epoch needs them (the
            fetcher's admission, within the memory budget): ``c``. The default memory budget
            holds this many row groups.
        fetch_threads: the threads that run them, one a read in flight: ``c``.
        footer_threads: shards' footers the constructor reads at once (at most one a shard): ``c``.
        first_batch_parts: the parts each read that an epoch's first batch waits on is split in,
            each on a connection of its own (and none under 1 MiB: ``ByteRange.parts``): ``c``,
            clamped so that ``in_flight * first_batch_parts <= CLIENT_CONNECTIONS`` (the
            connections of the process's S3 client, :data:`lakeshard.storage.CLIENT_CONNECTIONS`;
            a clamp is logged once, at INFO).
        read_ahead: the reads of the next epoch fetched after this epoch's last, at least (its
            first batch's, when they are more): ``c``, one round of reads in flight.

    ``c`` above ``CLIENT_CONNECTIONS`` is refused where the option is checked
    (:func:`loaders.options.values.read_concurrency`): there would be more reads in flight than
    connections to run them.
    """

    in_flight: int
    fetch_threads: int
    footer_threads: int
    first_batch_parts: int
    read_ahead: int

    @classmethod
    def of(cls, read_concurrency: int) -> ReadPlan:
        c = read_concurrency
        if not 0 < c <= CLIENT_CONNECTIONS:
            raise ValueError(f"read_concurrency must be in [1, {CLIENT_CONNECTIONS}], got {c!r}")
        parts = min(c, CLIENT_CONNECTIONS // c)
        if parts < c and c not in _LOGGED:
            _LOGGED.add(c)
            log.info(
                "read_concurrency=%d: an epoch's first reads go in %d parts each, not %d: %d reads in "
                "flight x %d parts fill the %d connections of the S3 client",
                c,
                parts,
                c,
                c,
                parts,
                CLIENT_CONNECTIONS,
            )
        return cls(in_flight=c, fetch_threads=c, footer_threads=c, first_batch_parts=parts, read_ahead=c)
