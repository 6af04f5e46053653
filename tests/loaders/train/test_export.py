"""The trainer's exporter: its Prometheus endpoint scraped over HTTP on 127.0.0.1 and parsed with
prometheus_client's own parser, the port released on close, and the errors when a port is taken
or a package is missing. TensorBoard is not installed here: its path is checked against a
stand-in writer that records what it is given (the tags, values and steps; not TensorBoard's
event files), and its absence against the real import failing."""

from __future__ import annotations

import math
import os
import socket
import sys
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lakeshard.errors import ConfigError
from loaders.train.export import EpochFigures, Exporter
from tests.helpers.procs import listening_addresses

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def figures(epoch: int, **changes: Any) -> EpochFigures:
    """Two ranks' figures; ``changes`` replace any."""
    values: dict[str, Any] = {
        "epoch": epoch,
        "images_per_s": 812.5,
        "loss": 1.25,
        "val_accuracy": 0.5,
        "data_wait_share": [0.1, 0.3],
        "requests": [10, 20],
        "bytes_read": [1000, 2000],
        "cache_bytes": [0, 500],
        "retries": [0, 2],
        "cost_usd": 0.25,
        "read_ms_mean": [12.0, 40.0],
        "shuffle_rank_correlation": 0.01,
        "same_group_share": 0.2,
        "straggler": 1,
    }
    values.update(changes)
    return EpochFigures(**values)


def scrape(port: int) -> tuple[Samples, dict[str, str]]:
    """Every sample on the endpoint, by (name, sorted labels), and each family's type."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: Samples = {}
    types_: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types_[family.name] = family.type
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples, types_


def ranked(rank: int) -> tuple[tuple[str, str], ...]:
    return (("rank", str(rank)),)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    with Exporter(port=0, addr="127.0.0.1") as e:
        yield e


def test_two_epochs_of_two_ranks_are_served_with_their_rank_labels(exporter: Exporter):
    assert exporter.port
    exporter.epoch(figures(1))
    exporter.epoch(
        figures(
            2,
            loss=None,
            data_wait_share=[0.05, 0.25],
            requests=[30, 45],
            bytes_read=[3000, 4500],
            cost_usd=0.5,
            straggler=0,
        )
    )
    got, kinds = scrape(exporter.port)

    assert got["lakeshard_epoch", ()] == 2
    assert got["lakeshard_images_per_s", ()] == 812.5
    assert math.isnan(got["lakeshard_loss", ()])  # None: no real rows
    assert got["lakeshard_val_accuracy", ()] == 0.5
    assert got["lakeshard_data_wait_share", ranked(0)] == 0.05
    assert got["lakeshard_data_wait_share", ranked(1)] == 0.25
    assert got["lakeshard_read_ms_mean", ranked(1)] == 40.0
    # The epoch's value, and the sum over both epochs.
    assert got["lakeshard_epoch_requests", ranked(1)] == 45
    assert got["lakeshard_requests_total", ranked(0)] == 40
    assert got["lakeshard_requests_total", ranked(1)] == 65
    assert got["lakeshard_bytes_read_total", ranked(1)] == 6500
    assert got["lakeshard_cache_bytes_total", ranked(1)] == 1000
    assert got["lakeshard_retries_total", ranked(1)] == 4
    assert got["lakeshard_epoch_cost_usd", ()] == 0.5
    assert got["lakeshard_cost_usd_total", ()] == 0.75
    assert got["lakeshard_straggler", ranked(0)] == 1
    assert got["lakeshard_straggler", ranked(1)] == 0
    assert kinds["lakeshard_requests"] == "counter"
    assert kinds["lakeshard_epoch_requests"] == "gauge"
    assert kinds["lakeshard_data_wait_share"] == "gauge"


def vars_of(f: EpochFigures) -> dict[str, Any]:
    return {name: getattr(f, name) for name in f.__dataclass_fields__}


def test_a_rank_gone_loses_its_gauges_and_keeps_its_totals(exporter: Exporter):
    assert exporter.port
    exporter.epoch(figures(1))
    one_rank = {name: [v[0]] for name, v in vars_of(figures(2)).items() if isinstance(v, list)}
    exporter.epoch(figures(2, **one_rank, straggler=None))
    got, _ = scrape(exporter.port)

    assert ("lakeshard_data_wait_share", ranked(0)) in got
    assert ("lakeshard_data_wait_share", ranked(1)) not in got
    assert ("lakeshard_epoch_requests", ranked(1)) not in got
    assert ("lakeshard_straggler", ranked(1)) not in got
    assert got["lakeshard_straggler", ranked(0)] == 0
    assert got["lakeshard_requests_total", ranked(0)] == 20
    assert got["lakeshard_requests_total", ranked(1)] == 20


def test_close_releases_the_port():
    exporter = Exporter(port=0, addr="127.0.0.1")
    port = exporter.port
    assert port
    exporter.close()
    exporter.close()  # idempotent
    assert exporter.port == port  # still says which port it was

    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    with Exporter(port=port, addr="127.0.0.1") as again:  # the port can be bound again at once
        assert again.port == port
        assert math.isnan(scrape(port)[0]["lakeshard_epoch", ()])  # no epoch exported yet


def test_the_endpoint_listens_on_127_0_0_1_unless_another_address_is_asked_for():
    """The kernel's own table of listening sockets says which address the endpoint is bound to."""
    with Exporter(port=0) as default:
        assert listening_addresses(default.port) == {"127.0.0.1"}
        scrape(default.port)
    for host, bound in (("::1", "::1"), ("[::1]", "::1"), ("0.0.0.0", "0.0.0.0")):
        with Exporter(port=0, addr=host) as other:
            assert listening_addresses(other.port) == {bound}
            url = (
                f"http://[::1]:{other.port}/metrics"
                if bound == "::1"
                else f"http://127.0.0.1:{other.port}/metrics"
            )
            with urllib.request.urlopen(url, timeout=5) as response:
                assert b"lakeshard_epoch" in response.read()
    with pytest.raises(
        ConfigError, match=r"metrics host 'no-such-host\.invalid' is not an address of this machine"
    ):
        Exporter(port=0, addr="no-such-host.invalid")


def test_a_port_in_use_is_a_config_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics port {port} on 127.0.0.1 is already in use"):
            Exporter(port=port, addr="127.0.0.1")


@pytest.mark.parametrize("port", [-1, 65536, "9464", True])
def test_a_bad_port_is_a_config_error(port: Any):
    with pytest.raises(ConfigError, match="metrics port must be an integer"):
        Exporter(port=port)


def test_ranks_other_than_0_export_nothing():
    exporter = Exporter(port=0, addr="127.0.0.1", rank=1)
    assert exporter.port is None
    exporter.epoch(figures(1))  # nothing to do, nothing raised
    exporter.close()


def test_nothing_is_exported_by_default():
    exporter = Exporter()
    exporter.epoch(figures(1))
    assert exporter.port is None
    exporter.close()


def test_without_prometheus_client_a_config_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"metrics port 0: .*pip install prometheus-client") as info:
        Exporter(port=0, rank=3)  # every rank checks, not only the one that serves
    assert "\n" not in str(info.value)


def test_without_tensorboard_a_config_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as without the package
    with pytest.raises(ConfigError, match=r"tensorboard_dir .*: .*pip install tensorboard") as info:
        Exporter(tensorboard_dir=str(tmp_path / "tb"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "tb").exists()


class RecordingWriter:
    """Stands in for ``torch.utils.tensorboard.SummaryWriter``: the same ``add_scalar(tag,
    scalar_value, global_step)``, ``flush()`` and ``close()``, recorded."""

    made: ClassVar[list[RecordingWriter]] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.scalars: dict[tuple[str, int], float] = {}
        self.flushes = 0
        self.closed = False
        RecordingWriter.made.append(self)

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.scalars[tag, global_step] = scalar_value

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def test_tensorboard_scalars_are_written_per_figure_and_per_rank(monkeypatch: pytest.MonkeyPatch):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = RecordingWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setattr(RecordingWriter, "made", [])

    with Exporter(tensorboard_dir="runs/x/tb") as exporter:
        assert exporter.port is None
        exporter.epoch(figures(1))
        exporter.epoch(figures(2, loss=None, val_accuracy=None, straggler=None, requests=[30, 45]))
    [writer] = RecordingWriter.made

    assert writer.log_dir == "runs/x/tb"
    assert writer.closed and writer.flushes == 2
    assert writer.scalars["loss", 1] == 1.25
    assert ("loss", 2) not in writer.scalars  # None is left out
    assert ("val_accuracy", 2) not in writer.scalars
    assert writer.scalars["straggler", 1] == 1
    assert ("straggler", 2) not in writer.scalars
    assert writer.scalars["requests/rank1", 2] == 45
    assert writer.scalars["data_wait_share/rank0", 1] == 0.1
    assert writer.scalars["cost_usd", 2] == 0.25
    assert {tag for tag, step in writer.scalars if step == 1} == {
        "images_per_s",
        "loss",
        "val_accuracy",
        "shuffle_rank_correlation",
        "same_group_share",
        "cost_usd",
        "straggler",
        *(
            f"{name}/rank{r}"
            for name in (
                "data_wait_share",
                "read_ms_mean",
                "requests",
                "bytes_read",
                "cache_bytes",
                "retries",
            )
            for r in (0, 1)
        ),
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"requests": [1]}, "one entry per rank"),
        (
            {
                "data_wait_share": [],
                "requests": [],
                "bytes_read": [],
                "cache_bytes": [],
                "retries": [],
                "read_ms_mean": [],
            },
            "at least one",
        ),
        ({"straggler": 2}, r"straggler must be a rank in \[0, 2\)"),
        ({"retries": [0, -1]}, "cannot be negative"),
    ],
)
def test_figures_that_do_not_fit_together_are_refused(changes: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        figures(1, **changes)


class MkdirWriter(RecordingWriter):
    """As ``SummaryWriter`` does first: make ``log_dir`` (a real ``os.makedirs``)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir)


def test_a_tensorboard_dir_the_writer_cannot_make_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = MkdirWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    (tmp_path / "afile").write_text("x")
    tb = str(tmp_path / "afile" / "tb")
    with pytest.raises(ConfigError) as info:
        Exporter(tensorboard_dir=tb)
    assert str(info.value).startswith(
        f"tensorboard_dir {tb!r}: cannot write TensorBoard scalars there: NotADirectoryError: "
    )
