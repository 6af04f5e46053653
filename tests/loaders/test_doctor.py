"""``python -m loaders.doctor``: the verdict on hand-made figures (each stage the bottleneck, the
ratio, the next steps), bad input as one error line, and three real situations whose bottleneck
is known (a slow store, a transform that burns CPU, a slow model step) through the real command.

The real situations are built so that the bottleneck is at least 10x slower than the next stage
on the 2-core CI machine, so a busy machine cannot change the verdict."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loader_builders import write_dataset

from loaders.doctor import (
    STAGES,
    DecodeFigures,
    DecodeRun,
    Figures,
    ModelFigures,
    Setup,
    StoreFigures,
    TogetherFigures,
    TransformFigures,
    cpu_rate,
    decide,
)
from loaders.doctor.command import main
from tests.helpers.store import RemoteStore, require_nginx

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m loaders.doctor: error: "


# -- the verdict on hand-made figures -----------------------------------------------------------------
def _figures(
    *,
    store_rows_per_s: float = 100_000,
    decode: tuple[DecodeRun, ...] = (DecodeRun(1, 1000, 1.0, 1.0), DecodeRun(2, 1900, 1.0, 2.0)),
    transform_images: int | None = None,
    transform_cpu_s: float = 1.0,
    model_images_per_s: float | None = None,
    model_device: str = "cuda (H100)",
    together: TogetherFigures | None = None,
    **setup: object,
) -> Figures:
    """Figures with the given rates: the store yields ``store_rows_per_s`` in 1 s, the model takes
    ``model_images_per_s`` in 1 s, the transform costs ``transform_cpu_s`` for
    ``transform_images`` images; ``setup`` overrides :class:`Setup` fields."""
    base = {
        "dataset": "s3://lake/ds",
        "channel": "train",
        "rank": 0,
        "world_size": 1,
        "batch_size": 64,
        "threads": 2,
        "cores": 2,
        "gpu": None,
        "image_size": 64,
        "input_size": 64,
        "remote": False,
        "cache_dir": None,
        "read_concurrency": 8,
        "batch_decoder": True,
        "transform": None,
        "model": None,
    }
    store_fields = {
        k: setup.pop(k) for k in ("reads", "read_s", "cache_hits", "cache_misses", "bytes") if k in setup
    }
    store = StoreFigures(
        rows=int(store_rows_per_s),
        batches=1,
        seconds=1.0,
        bytes=int(store_fields.pop("bytes", 10**6)),
        open_s=0.1,
        first_batch_s=0.01,
        first_rows=int(store_rows_per_s),
        epochs=1,
        **store_fields,
    )
    transform = (
        None
        if transform_images is None
        else TransformFigures(
            transform_images, 1.0, transform_cpu_s, transform_cpu_s, "(uint8 [64, 3, 8, 8])"
        )
    )
    model = (
        None
        if model_images_per_s is None
        else ModelFigures(model_device, (64, 3, 8, 8), 10, int(model_images_per_s), 1.0, 5)
    )
    return Figures(
        Setup(**{**base, **setup}),
        store,
        DecodeFigures(sample=1000, sample_bytes=10**6, runs=decode),
        together or TogetherFigures(100, 2, 1.0, 0.5, 0.0, 0, model is not None),
        transform,
        model,
    )


def _with(figures: Figures, **setup: object) -> Figures:
    """``figures`` with ``setup`` fields replaced."""
    return dataclasses.replace(figures, setup=dataclasses.replace(figures.setup, **setup))


def _actions(figures: Figures) -> list[str]:
    return [s.action for s in decide(figures).steps]


def test_decode_and_transform_rate_spends_the_busy_cores_on_both_costs():
    # 2 threads kept 1.6 cores busy decoding 2,000 images/s: 0.8 ms CPU an image; the transform
    # costs 0.2 ms: 1.6 cores / 1.0 ms = 1,600 images/s.
    runs = (DecodeRun(1, 1100, 1.0, 0.88), DecodeRun(2, 2000, 1.0, 1.6))
    assert cpu_rate(_figures(decode=runs)) == pytest.approx(2000)
    assert cpu_rate(_figures(decode=runs, transform_images=1000, transform_cpu_s=0.2)) == pytest.approx(1600)
    # More threads measured than --threads: only the runs it may use count.
    assert cpu_rate(_figures(decode=runs, threads=1)) == pytest.approx(1100)


def test_the_rates_count_from_the_first_batch_on():
    # 11 batches of 30 in 2 s, the first after 0.5 s (all of it waiting), 0.4 s of waits after it.
    together = TogetherFigures(330, 11, 2.0, 0.9, 0.5, 30, True)
    assert together.images_per_s == pytest.approx(300 / 1.5)
    assert together.wait_share == pytest.approx(0.4 / 1.5)
    alone = TogetherFigures(30, 1, 2.0, 2.0, 2.0, 30, True)  # one batch: the whole time
    assert (alone.images_per_s, alone.wait_share) == (15, 1)
    # The store stage counts the same way; its bytes/s is the row rate times the bytes a row.
    store = StoreFigures(
        rows=330, batches=11, seconds=2.0, bytes=3300, open_s=0, first_batch_s=0.5, first_rows=30, epochs=1
    )
    assert (store.rows_per_s, store.bytes_per_s) == (pytest.approx(200), pytest.approx(2000))


def test_the_transform_as_bottleneck_is_named_with_the_ratio_to_the_next_stage():
    # 2 cores busy, decode 1/820 s and transform 3/820 s an image: 2 / (4/820) = 410 images/s.
    figures = _figures(
        decode=(DecodeRun(1, 820, 1.0, 1.0), DecodeRun(2, 1640, 1.0, 2.0)),
        transform_images=820,
        transform_cpu_s=3.0,
        model_images_per_s=1900,
        transform="mynets.aug:crop",
    )
    verdict = decide(figures)
    assert verdict.bottleneck == "transform" and verdict.next_stage == "model"
    assert verdict.ratio == pytest.approx(1900 / 410)
    assert verdict.headline == (
        "decoding and the transform (410 images/s on 2 cores) bound training: the model could take 1,900 "
        "images/s, 4.6x more"
    )
    assert [s.action for s in verdict.steps] == ["lighter_transform", "prep_cluster"]
    assert "3.66 ms of CPU per image, 3.0x decoding's 1.22 ms" in verdict.steps[0].text
    # With a core to spare, more threads come before the cluster.
    assert _actions(_with(figures, threads=1)) == ["lighter_transform", "more_threads"]


def test_a_remote_store_as_bottleneck_asks_for_a_cache_and_more_reads_in_flight():
    slow = {"remote": True, "reads": 20, "read_s": 18.0, "bytes": 3_000_000}  # 900 ms, 150 kB a read
    verdict = decide(_figures(store_rows_per_s=150, **slow))
    assert (verdict.bottleneck, verdict.next_stage) == ("store", "decode_transform")
    assert verdict.ratio == pytest.approx(1900 / 150)
    assert verdict.headline == (
        "the store (150 rows/s, remote) bounds training: decoding could keep up with 1,900 images/s, 12.7x more"
    )
    assert [s.action for s in verdict.steps] == ["cache_dir", "read_concurrency"]
    reads = verdict.steps[1].text
    assert "now 8; try 16" in reads and "900 ms for 150 kB each" in reads and "latency-bound" in reads
    # Fast reads on a slow link are not latency-bound.
    quick = decide(_figures(store_rows_per_s=150, **{**slow, "read_s": 0.4})).steps[1].text
    assert "latency-bound" not in quick and "until the link or the store is full" in quick
    # A cache being filled while measured: measure again; a full cache that is still slowest: its disk.
    filling = decide(_figures(store_rows_per_s=150, cache_dir="/c", cache_hits=2, cache_misses=18, **slow))
    assert [s.action for s in filling.steps] == ["cache_dir", "read_concurrency"]
    assert "18 of 20 row groups came from the store" in filling.steps[0].text
    cached = {"remote": True, "cache_dir": "/c", "cache_hits": 20, "bytes": 3_000_000}
    assert _actions(_figures(store_rows_per_s=150, **cached)) == ["faster_disk"]
    assert "from the local cache" in decide(_figures(store_rows_per_s=150, **cached)).headline
    assert _actions(_figures(store_rows_per_s=150)) == ["faster_disk"]  # a local disk


def test_decoding_as_bottleneck_adds_cores_while_it_scales_then_a_cluster():
    scaling = (DecodeRun(1, 1000, 1.0, 1.0), DecodeRun(2, 1900, 1.0, 2.0))  # 95% per thread
    figures = _figures(decode=scaling, model_images_per_s=5000)
    verdict = decide(figures)
    assert (verdict.bottleneck, verdict.next_stage) == ("decode", "model")
    assert verdict.headline == (
        "decoding (1,900 images/s on 2 cores) bounds training: the model could take 5,000 images/s, 2.6x more"
    )
    assert [s.action for s in verdict.steps] == ["more_cores", "prep_cluster"]
    assert "95% per-thread efficiency at 2 threads" in verdict.steps[0].text
    assert "prep=" in verdict.steps[1].text
    assert _actions(_with(figures, cores=8)) == ["more_threads"]
    assert _actions(_with(figures, image_size=256, input_size=128, gpu="H100")) == [
        "more_cores",
        "smaller_images",
        "gpu_decode",
        "prep_cluster",
    ]
    assert "up to 4.0x faster" in decide(_with(figures, image_size=256, input_size=128)).steps[1].text
    # Poor scaling: no more cores; without the C extension, build it.
    poor = _figures(decode=(DecodeRun(1, 1000, 1.0, 1.0), DecodeRun(2, 1000, 1.0, 1.0)), batch_decoder=False)
    verdict = decide(poor)
    assert [s.action for s in verdict.steps] == ["extension", "prep_cluster"]
    assert any("50% per-thread efficiency" in n for n in verdict.notes)


def test_the_model_as_bottleneck_says_the_data_keeps_up():
    verdict = decide(_figures(model_images_per_s=300))
    assert (verdict.bottleneck, verdict.next_stage) == ("model", "decode_transform")
    assert verdict.ratio == pytest.approx(1900 / 300)
    assert verdict.headline.startswith("the model (300 images/s on cuda (H100)) bounds training")
    assert [s.action for s in verdict.steps] == ["model"]
    assert verdict.steps[0].text.startswith("the data keeps up; the model is the limit")
    # On the CPU, together well below the slowest stage: they share the cores.
    together = TogetherFigures(100, 2, 1.0, 0.6, 0.0, 0, True)
    verdict = decide(_figures(model_images_per_s=300, model_device="cpu", together=together))
    assert verdict.together_share == pytest.approx(100 / 300)
    assert any("same CPU cores" in n for n in verdict.notes)
    assert any("yet the loop waited 60% for data" in n for n in verdict.notes)
    assert [s.action for s in verdict.steps] == ["model", "split_cores"]
    assert "together ran at 33% of the slowest stage alone" in verdict.steps[1].text


def test_close_stages_are_called_close_and_a_verdict_is_json():
    figures = _figures(model_images_per_s=1700, transform_images=10**6, transform_cpu_s=0.0)
    verdict = decide(figures)
    assert verdict.bottleneck == "model" and any("close behind (1.12x)" in n for n in verdict.notes)
    for case in (figures, _figures(store_rows_per_s=10), _figures(transform_images=10, transform_cpu_s=1.0)):
        verdict = decide(case)
        assert verdict.bottleneck in STAGES
        again = json.loads(json.dumps({**verdict.to_json(), "figures": case.to_json()}))
        assert again["bottleneck"] == verdict.bottleneck and again["next_steps"][0]["action"]


# -- bad input: one line, status 2, nothing measured ------------------------------------------------
PARTS = "tests.helpers.doctor_parts"


@pytest.mark.parametrize(
    "args, named",
    [
        (["--dataset", "{missing}"], "no complete dataset at file://"),
        ([], "dataset is required: pass --dataset URI"),
        (["--dataset", "{ds}", "--channel", "holdout"], "--channel (command line): must be one of train"),
        (["--dataset", "{ds}", "--model", "no_such_pkg.nets:build"], "cannot import no_such_pkg.nets"),
        (["--dataset", "{ds}", "--model", "resnet18"], "--model 'resnet18': expected package.module:factory"),
        (
            ["--dataset", "{ds}", "--model", f"{PARTS}:wrong_logits"],
            "the model returned a tensor of shape [2, 4] for a float32 [2, 3, 8, 8] batch; expected logits of shape [2, 3]",
        ),
        (
            ["--dataset", "{ds}", "--transform", f"{PARTS}:missing"],
            f"--transform '{PARTS}:missing': cannot import it: AttributeError: module '{PARTS}' has no attribute 'missing'",
        ),
        (
            ["--dataset", "{ds}", "--transform", f"{PARTS}:NOT_CALLABLE"],
            "NOT_CALLABLE' is not callable, got int",
        ),
        (["--dataset", "{ds}", "--transform", f"{PARTS}:burn", "--augment"], "pass one of them"),
        (["--dataset", "{ds}", "--crop", "99"], "--crop 99: must be at most the image size 8"),
        (["--dataset", "{ds}", "--seconds", "0"], "--seconds (command line): must be a positive number"),
    ],
)
def test_bad_input_is_one_error_line_and_status_2(
    args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    write_dataset(tmp_path / "ds")
    argv = [a.format(ds=tmp_path / "ds", missing=tmp_path / "missing") for a in args]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1, err  # no stage began
    assert lines[0].startswith(PROG) and named in lines[0]


def _doctor(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {**(env or os.environ), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "loaders.doctor", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("seconds", ["inf", "Infinity", "nan"])
def test_the_command_refuses_endless_seconds_in_one_line(seconds: str, tmp_path: Path):
    write_dataset(tmp_path / "ds")
    # before the fix, inf measured the store for ever: the bound turns that into a failure
    proc = _doctor(["--dataset", str(tmp_path / "ds"), "--seconds", seconds], timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"{PROG}--seconds (command line): must be a positive number, finite (each stage is "
        f"measured that long), got {float(seconds)!r}"
    ]


@pytest.mark.slow
def test_the_command_refuses_a_bad_transform_in_one_line(tmp_path: Path):
    write_dataset(tmp_path / "ds")
    proc = _doctor(["--dataset", str(tmp_path / "ds"), "--transform", "no_such_pkg.aug:crop"])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"{PROG}--transform 'no_such_pkg.aug:crop': cannot import it: "
        "ModuleNotFoundError: No module named 'no_such_pkg'"
    ]


# -- three real situations, through the command -----------------------------------------------------
def _diagnose(args: list[str], *, env: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """The JSON report of ``python -m loaders.doctor ARGS --json --seconds 2`` and its progress lines."""
    proc = _doctor([*args, "--json", "--seconds", "2"], env=env)
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("measuring ")]
    return json.loads(proc.stdout), progress


@pytest.mark.slow
def test_a_slow_store_is_the_bottleneck(tmp_path: Path):
    require_nginx()
    lake = tmp_path / "lake"
    write_dataset(
        lake / "ds",
        rows={"train": 240, "validation": 4, "test": 4},
        size=32,
        fmt="jpeg",
        noise=True,
        row_group_rows=20,
    )
    with RemoteStore(lake, latency_ms=300, bandwidth=200_000) as store:
        env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL_S3"}
        report, progress = _diagnose(
            ["--dataset", store.uri("ds"), "--batch-size", "16"], env={**env, **store.environ()}
        )
    assert report["bottleneck"] == "store", report["headline"]
    assert report["ratio"] >= 2
    assert [s["action"] for s in report["next_steps"]] == ["cache_dir", "read_concurrency"]
    store_figures = report["figures"]["store"]
    assert report["figures"]["setup"]["remote"] and store_figures["requests"] > 0
    assert store_figures["read_ms_mean"] >= 300  # the store's latency, at least
    assert len(progress) == 3 and "remote store" in progress[0]  # store, decode, together


def _jpegs(root: Path, task: str | None = None) -> None:
    """600 noisy 32 px JPEGs in row groups of 50: decoding them is cheap next to the stage a test
    slows (``task``: of a multi-label or boxes dataset)."""
    write_dataset(
        root,
        rows={"train": 600, "validation": 4, "test": 4},
        size=32,
        fmt="jpeg",
        noise=True,
        row_group_rows=50,
        task=task,
    )


@pytest.mark.slow
def test_a_transform_that_burns_cpu_is_the_bottleneck(tmp_path: Path):
    _jpegs(tmp_path / "ds")
    report, progress = _diagnose(
        ["--dataset", str(tmp_path / "ds"), "--transform", f"{PARTS}:burn", "--batch-size", "32"]
    )
    assert report["bottleneck"] == "transform", report["headline"]
    assert report["ratio"] >= 2
    transform = report["figures"]["transform"]
    assert transform["cpu_s_per_image"] > 2e-3  # ~7 ms of CPU an image
    assert transform["cpu_s_per_image"] > 5 * report["figures"]["decode"]["cpu_s_per_image"]
    assert report["next_steps"][0]["action"] == "lighter_transform"
    assert len(progress) == 4 and "transform" in progress[2]


@pytest.mark.slow
def test_a_transform_that_waits_is_the_bottleneck(tmp_path: Path):
    """3 ms an image of waiting and no computing: the cores idle, the threads do not."""
    _jpegs(tmp_path / "ds")
    args = ["--dataset", str(tmp_path / "ds"), "--transform", f"{PARTS}:wait", "--batch-size", "32"]
    report, _ = _diagnose([*args, "--threads", "2"])
    assert report["bottleneck"] == "transform", report["headline"]
    transform = report["figures"]["transform"]
    assert transform["wall_s_per_image"] >= 3e-3 > 10 * transform["cpu_s_per_image"]
    assert report["rates"]["decode_transform"] <= 2 / 3e-3  # 2 threads, each at most 1 image per 3 ms
    assert report["next_steps"][0]["action"] == "lighter_transform"
    assert "it waits" in report["next_steps"][0]["text"]
    assert "faster_disk" not in [s["action"] for s in report["next_steps"]]


@pytest.mark.slow
def test_a_small_share_of_a_channel_is_not_called_a_slow_disk(tmp_path: Path):
    """One row per rank: the store stage restarts epoch after epoch, and that is what it times."""
    write_dataset(tmp_path / "ds", rows={"train": 16, "validation": 4, "test": 4})
    report, _ = _diagnose(["--dataset", str(tmp_path / "ds"), "--world-size", "16", "--batch-size", "4"])
    assert report["bottleneck"] == "store", report["headline"]
    assert report["figures"]["store"]["epochs"] >= 3
    actions = [s["action"] for s in report["next_steps"]]
    assert actions[0] == "epoch_start" and "faster_disk" not in actions, report["next_steps"]
    assert "this rank's share (0 of 16) is 1 row an epoch" in report["next_steps"][0]["text"]


@pytest.mark.slow
def test_a_slow_model_step_is_the_bottleneck(tmp_path: Path):
    _jpegs(tmp_path / "ds")
    report, progress = _diagnose(
        ["--dataset", str(tmp_path / "ds"), "--model", f"{PARTS}:slow_model", "--batch-size", "32"]
    )
    assert report["bottleneck"] == "model", report["headline"]
    assert report["ratio"] >= 2
    model = report["figures"]["model"]
    assert model["input_shape"] == [32, 3, 32, 32] and model["steps"] >= 2
    # The model first; split_cores follows where together ran under half the model's rate alone,
    # as it does on a machine whose other work takes the cores (the test suite's other worker).
    actions = [s["action"] for s in report["next_steps"]]
    assert actions[0] == "model" and set(actions[1:]) <= {"split_cores"}, report["next_steps"]
    assert report["figures"]["together"]["with_model"] and len(progress) == 4


@pytest.mark.slow
def test_a_boxes_transform_that_burns_cpu_is_timed_on_the_batch_and_named(tmp_path: Path):
    """The transform gets what the loader gives it on a boxes dataset: the images and a
    ``loaders.Batch`` (``burn_boxes`` fails on anything else)."""
    _jpegs(tmp_path / "ds", task="boxes")
    report, progress = _diagnose(
        ["--dataset", str(tmp_path / "ds"), "--transform", f"{PARTS}:burn_boxes", "--batch-size", "32"]
    )
    assert report["bottleneck"] == "transform", report["headline"]
    transform = report["figures"]["transform"]
    assert transform["output"] == "(uint8 [32, 3, 32, 32], Batch)"
    assert transform["cpu_s_per_image"] > 5 * report["figures"]["decode"]["cpu_s_per_image"]
    assert report["next_steps"][0]["action"] == "lighter_transform"
    assert len(progress) == 4 and "transform" in progress[2]


@pytest.mark.slow
def test_a_slow_model_step_on_a_multi_label_dataset_is_the_bottleneck(tmp_path: Path):
    """The model step takes the batches' multi-hot labels (binary cross-entropy), alone and fed
    by the loader (with augment's transform, which gets the ``loaders.Batch``)."""
    _jpegs(tmp_path / "ds", task="multi-label")
    report, progress = _diagnose(
        [
            "--dataset",
            str(tmp_path / "ds"),
            "--model",
            f"{PARTS}:slow_model",
            "--augment",
            "--batch-size",
            "32",
        ]
    )
    assert report["bottleneck"] == "model", report["headline"]
    assert report["figures"]["transform"]["output"] == "(uint8 [32, 3, 32, 32], Batch)"
    assert report["figures"]["together"]["with_model"] and len(progress) == 5


def test_a_model_on_a_boxes_dataset_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    write_dataset(tmp_path / "ds", task="boxes", size=16)
    assert main(["--dataset", str(tmp_path / "ds"), "--model", f"{PARTS}:slow_model"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PROG) and "is a boxes dataset" in lines[0], lines
