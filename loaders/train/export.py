"""The trainer's per-epoch figures, exported besides ``metrics.json``: as Prometheus metrics on an
HTTP endpoint (``prometheus_client``, the ``metrics`` extra) and as TensorBoard scalars (when the
``tensorboard`` package is installed). Nothing is exported unless asked for.

    exporter = Exporter(port=9464, tensorboard_dir="runs/pets/tb", rank=world.rank)
    ...
    exporter.epoch(EpochFigures(epoch=1, images_per_s=812.0, ...))  # after each epoch
    exporter.close()

The Prometheus metrics (``/metrics``; ``rank`` label on every per-rank figure):

- ``lakeshard_epoch``: the last epoch exported.
- A figure that is one number per epoch: a gauge ``lakeshard_<figure>`` (NaN when the figure is
  None: no loss without real rows, no accuracy without a validation channel).
- A per-rank figure that adds up over epochs (requests, bytes read, cache bytes, retries, and the
  cost, which has no rank label): the epoch's value as a gauge ``lakeshard_epoch_<figure>`` and
  the sum over the epochs this process exported as a counter ``lakeshard_<figure>_total`` (it
  starts again from 0 when the process does, after a resume too, as any counter does).
- ``lakeshard_straggler``: 1 for the rank named as straggler, 0 for the others.

Gauges of ranks that no longer exist (an elastic run that shrank) are removed; counters keep them.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
from dataclasses import dataclass, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any

from lakeshard.errors import ConfigError

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import Counter, Gauge

__all__ = ["EpochFigures", "Exporter"]

log = logging.getLogger(__name__)

_NS = "lakeshard"

#: Per-rank figures that are one epoch's reading: (field, help).
_RANK_GAUGES = (
    ("data_wait_share", "Share of the epoch's step time spent waiting for data."),
    ("read_ms_mean", "Mean latency of one store read in the epoch, in milliseconds."),
)
#: Per-rank figures that add up over epochs: (field, help of the epoch's value).
_RANK_COUNTS = (
    ("requests", "GET requests to the store"),
    ("bytes_read", "Bytes read from the store"),
    ("cache_bytes", "Bytes read from the local cache"),
    ("retries", "Store reads retried"),
)
#: One number per epoch, None allowed where the field's type says so: (field, help).
_SCALARS = (
    ("images_per_s", "Images trained per second in the epoch, all ranks, over the slowest rank's time."),
    ("loss", "Mean training loss of the epoch over its real rows (NaN: none)."),
    ("val_accuracy", "Top-1 validation accuracy after the epoch (NaN: no validation channel)."),
    (
        "shuffle_rank_correlation",
        "Spearman rank correlation of the epoch's yield order with the stored order: 1 = stored order, "
        "about 0 = a full shuffle (NaN: not measured).",
    ),
    (
        "same_group_share",
        "Mean over the epoch's batches of the probability that two rows of a batch come from the same "
        "row group (NaN: not measured).",
    ),
)


@dataclass(frozen=True, slots=True)
class EpochFigures:
    """One epoch's figures as the trainer exports them, already gathered from every rank: each
    list has one entry per rank, index = rank, all of the same length (the world size)."""

    epoch: int
    images_per_s: float
    loss: float | None
    val_accuracy: float | None
    data_wait_share: list[float]
    requests: list[int]  # GET requests to the store this epoch
    bytes_read: list[int]  # bytes from the store
    cache_bytes: list[int]  # bytes read from the local cache
    retries: list[int]
    cost_usd: float  # estimated, all ranks
    read_ms_mean: list[float]  # mean latency of one store read
    shuffle_rank_correlation: float | None  # loaders._internal.shuffle_quality; None: not measured
    same_group_share: float | None
    straggler: int | None  # the rank named as straggler

    def __post_init__(self) -> None:
        per_rank = {
            f.name: len(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), list)
        }
        world_size = per_rank["data_wait_share"]
        if world_size == 0 or any(n != world_size for n in per_rank.values()):
            raise ValueError(
                f"EpochFigures of epoch {self.epoch}: every per-rank list needs one entry per rank (at least one), got lengths {per_rank}"
            )
        negative = {
            name: getattr(self, name) for name, _ in _RANK_COUNTS if any(v < 0 for v in getattr(self, name))
        }
        if self.cost_usd < 0:
            negative["cost_usd"] = self.cost_usd
        if negative:
            raise ValueError(f"EpochFigures of epoch {self.epoch}: counts cannot be negative, got {negative}")
        if self.straggler is not None and not 0 <= self.straggler < world_size:
            raise ValueError(
                f"EpochFigures of epoch {self.epoch}: straggler must be a rank in [0, {world_size}) or None, got {self.straggler!r}"
            )

    @property
    def world_size(self) -> int:
        return len(self.data_wait_share)


# NOTE [ Metrics server shutdown ]
# start_http_server() binds the port in the calling thread (so a port in use raises here, in
# __init__) and serves it from a daemon thread of its own, each scrape in a thread of its own.
# epoch() sets the metrics from the training thread; prometheus_client locks each value, so a
# scrape sees every value whole, though maybe one epoch's gauges beside the last epoch's (a
# scrape between two sets). close() is called from the training thread: server.shutdown() asks
# serve_forever() to return and waits for it (up to its 0.5 s poll interval), server_close()
# then closes the listening socket (shutdown() alone leaves the port bound:
# prometheus/client_python#1068), and the thread is joined. A scrape in flight may be cut off.
# The TensorBoard writer's own thread is flushed and stopped by SummaryWriter.close().


class Exporter:
    """Where the trainer's per-epoch figures go besides ``metrics.json``: a Prometheus endpoint
    (``port``), TensorBoard scalars (``tensorboard_dir``). Only rank 0 exports (the figures are
    already gathered from every rank); on other ranks :meth:`epoch` does nothing.

    Every rank checks that what was asked for is installed (so that all raise alike, before any
    collective); only rank 0 binds the port and opens the writer.

    Args:
        port: serve ``http://<addr>:<port>/metrics``; 0 picks a free port (read it from
            :attr:`port`). None: no Prometheus endpoint.
        tensorboard_dir: write TensorBoard scalars there (``torch.utils.tensorboard``). None: none.
        rank: this process's rank.
        addr: the address to bind: ``"127.0.0.1"`` (this machine only) by default; an interface's
            address, ``"0.0.0.0"`` (every IPv4 interface) or an IPv6 address (``"::"``, ``"[::1]"``)
            lets another machine scrape them.

    Raises:
        ConfigError: a bad port, a port that cannot be bound (in use, say), a TensorBoard folder
            that cannot be written, or a package missing.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        tensorboard_dir: str | None = None,
        rank: int = 0,
        addr: str = "127.0.0.1",
    ) -> None:
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
        ):
            raise ConfigError(
                f"metrics port must be an integer in [0, 65535] (0: any free port), got {port!r}"
            )
        #: The port the metrics are served on (the one picked when 0 was asked for); None when
        #: there is no endpoint here (none asked for, or not rank 0).
        self.port: int | None = None
        self.rank = rank
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._writer: Any = None  # a SummaryWriter: typed loosely, tensorboard may be absent
        self._gauges: dict[str, Gauge] = {}
        self._counters: dict[str, Counter] = {}
        self._ranks: set[str] = set()  # the rank labels the gauges have now

        writer_class = _summary_writer_class(tensorboard_dir) if tensorboard_dir is not None else None
        if port is not None:
            _import_prometheus(port)
        if rank != 0:
            return
        try:
            if port is not None:
                self._start_prometheus(port, addr)
            if writer_class is not None and tensorboard_dir is not None:
                self._writer = _open_writer(writer_class, tensorboard_dir)
                log.info("writing TensorBoard scalars to %s", tensorboard_dir)
        except BaseException:
            self.close()
            raise

    def _start_prometheus(self, port: int, addr: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        registry = CollectorRegistry()
        rank = ["rank"]
        self._gauges["epoch"] = Gauge(
            f"{_NS}_epoch", "The last epoch exported (NaN: none yet).", registry=registry
        )
        self._gauges["epoch"].set(math.nan)
        for name, text in _SCALARS:
            self._gauges[name] = Gauge(f"{_NS}_{name}", text, registry=registry)
        self._gauges["epoch_cost_usd"] = Gauge(
            f"{_NS}_epoch_cost_usd",
            "Estimated store cost of the epoch in US dollars, all ranks.",
            registry=registry,
        )
        self._counters["cost_usd"] = Counter(
            f"{_NS}_cost_usd",
            "Estimated store cost in US dollars, all ranks, over the epochs exported.",
            registry=registry,
        )
        for name, text in _RANK_GAUGES:
            self._gauges[name] = Gauge(f"{_NS}_{name}", text, rank, registry=registry)
        for name, text in _RANK_COUNTS:
            self._gauges[f"epoch_{name}"] = Gauge(
                f"{_NS}_epoch_{name}", f"{text} in the epoch.", rank, registry=registry
            )
            self._counters[name] = Counter(
                f"{_NS}_{name}", f"{text}, over the epochs exported.", rank, registry=registry
            )
        self._gauges["straggler"] = Gauge(
            f"{_NS}_straggler",
            "1 for the rank named as the epoch's straggler, 0 for the others.",
            rank,
            registry=registry,
        )
        try:
            host = addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr  # [::1]: IPv6
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except socket.gaierror as e:
            raise ConfigError(
                f"metrics host {addr!r} is not an address of this machine: {e.strerror or e}; "
                "pass an interface's address, 0.0.0.0 or :: (every interface) or 127.0.0.1"
            ) from e
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics port {port} on {addr} is already in use: pick another port, or 0 for any free one"
                ) from e
            raise ConfigError(f"cannot serve metrics on {addr} port {port}: {e.strerror or e}") from e
        self.port = self._server.server_port
        shown = f"[{host}]" if ":" in host else host
        log.info("serving Prometheus metrics on http://%s:%d/metrics", shown, self.port)

    def epoch(self, figures: EpochFigures) -> None:
        """Exports one epoch's figures: sets the gauges, adds to the counters, writes the
        TensorBoard scalars at step ``figures.epoch`` (and flushes them). Does nothing on a rank
        other than 0."""
        if self.rank != 0:
            return
        if self._server is not None:
            self._set_prometheus(figures)
        if self._writer is not None:
            self._write_tensorboard(figures)

    def _set_prometheus(self, figures: EpochFigures) -> None:
        ranks = [str(r) for r in range(figures.world_size)]
        for gone in self._ranks - set(ranks):
            for name, _ in _RANK_GAUGES:
                self._gauges[name].remove(gone)
            for name, _ in _RANK_COUNTS:
                self._gauges[f"epoch_{name}"].remove(gone)
            self._gauges["straggler"].remove(gone)
        self._ranks = set(ranks)

        self._gauges["epoch"].set(figures.epoch)
        for name, _ in _SCALARS:
            value = getattr(figures, name)
            self._gauges[name].set(math.nan if value is None else value)
        self._gauges["epoch_cost_usd"].set(figures.cost_usd)
        self._counters["cost_usd"].inc(figures.cost_usd)
        for name, _ in _RANK_GAUGES:
            for label, value in zip(ranks, getattr(figures, name)):
                self._gauges[name].labels(label).set(value)
        for name, _ in _RANK_COUNTS:
            for label, value in zip(ranks, getattr(figures, name)):
                self._gauges[f"epoch_{name}"].labels(label).set(value)
                self._counters[name].labels(label).inc(value)
        for r, label in enumerate(ranks):
            self._gauges["straggler"].labels(label).set(1 if r == figures.straggler else 0)

    def _write_tensorboard(self, figures: EpochFigures) -> None:
        step = figures.epoch
        for name, _ in _SCALARS:
            value = getattr(figures, name)
            if value is not None:
                self._writer.add_scalar(name, value, step)
        self._writer.add_scalar("cost_usd", figures.cost_usd, step)
        if figures.straggler is not None:
            self._writer.add_scalar("straggler", figures.straggler, step)
        for name in [n for n, _ in _RANK_GAUGES] + [n for n, _ in _RANK_COUNTS]:
            for r, value in enumerate(getattr(figures, name)):
                self._writer.add_scalar(f"{name}/rank{r}", value, step)
        self._writer.flush()

    def close(self) -> None:
        """Stops the endpoint and releases its port, and closes the TensorBoard writer (see the
        NOTE above). Idempotent."""
        server, thread, writer = self._server, self._thread, self._writer
        self._server = self._thread = self._writer = None
        try:
            if server is not None:
                server.shutdown()
                server.server_close()
            if thread is not None:
                thread.join(timeout=5)
        finally:
            if writer is not None:
                writer.close()

    def __enter__(self) -> Exporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _import_prometheus(port: int) -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"metrics port {port}: Prometheus metrics need prometheus_client: pip install prometheus-client (or the lakeshard[metrics] extra)"
        ) from e


def _open_writer(writer_class: Any, tensorboard_dir: str) -> Any:
    """A ``SummaryWriter`` on ``tensorboard_dir``; a folder it cannot write is a ConfigError (a
    file in the path, no permission, TensorBoard's own S3 client without credentials), so that
    the trainer stops every rank with one line."""
    try:
        return writer_class(log_dir=tensorboard_dir)
    except Exception as e:  # OSError, botocore's errors: whatever the writer's file system raises
        raise ConfigError(
            f"tensorboard_dir {tensorboard_dir!r}: cannot write TensorBoard scalars there: {type(e).__name__}: {e}"
        ) from e


def _summary_writer_class(tensorboard_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"tensorboard_dir {tensorboard_dir!r}: TensorBoard scalars need the tensorboard package: pip install tensorboard"
        ) from e
    return SummaryWriter
