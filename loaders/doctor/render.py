"""The readable report: what was measured (a table, one row a stage), then the verdict and the
next steps with the figures behind them."""

from __future__ import annotations

from loaders.doctor.figures import Figures
from loaders.doctor.rates import best_run, cpu_rate, num, thread_rate
from loaders.doctor.verdict import Verdict

__all__ = ["render"]

_WIDTH = 34


def _row(name: str, text: str) -> str:
    return f"{name:<{_WIDTH}}{text}"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.3g} ms"


def _store_row(figures: Figures) -> str:
    setup, s = figures.setup, figures.store
    where = "remote" if setup.remote else "local disk"
    if setup.remote and setup.cache_dir is not None:
        where += ", cached" if s.cached else ", cache filling"
    text = (
        f"{num(s.rows_per_s)} rows/s, {num(s.bytes_per_s / 1e6)} MB/s from the first batch on ({s.rows} rows, {s.epochs} epoch"
        f"{'s' if s.epochs != 1 else ''} in {s.seconds:.1f} s; first batch {s.first_batch_s:.2f} s"
    )
    if setup.remote:
        text += f"; opened in {s.open_s:.2f} s; {s.requests} requests, {num(s.read_ms_mean)} ms a read"
        if setup.cache_dir is not None:
            text += f"; {s.cache_hits} of {s.cache_hits + s.cache_misses} row groups from the cache"
    return _row(f"store ({where})", text + ")")


def _cpu_rows(figures: Figures) -> list[str]:
    """The decode runs, the transform, and what they make on this machine's cores (and threads)."""
    setup, decode = figures.setup, figures.decode
    lines: list[str] = []
    for run in decode.runs:
        text = f"{num(run.images_per_s)} images/s, {_ms(run.cpu_s_per_image)} CPU an image"
        if run is not decode.runs[0]:
            text += f", {decode.efficiency(run):.0%} per-thread efficiency"
        lines.append(_row(f"decode, {run.threads} thread{'s' if run.threads != 1 else ''}", text))
    t = figures.transform
    if t is not None:
        lines.append(
            _row(
                "transform, 1 thread",
                f"{_ms(t.cpu_s_per_image)} CPU, {_ms(t.wall_s_per_image)} wall an image -> {t.output} "
                f"({t.images} images)",
            )
        )
    name = "decode + transform" if t is not None else "decode"
    best = best_run(figures)
    per_image = (
        _ms(best.cpu_s_per_image) if t is None else f"{_ms(best.cpu_s_per_image)} + {_ms(t.cpu_s_per_image)}"
    )
    lines.append(
        _row(
            f"{name} on {setup.threads} cores",
            f"{num(cpu_rate(figures))} images/s = min({setup.threads}, {best.busy_cores:.2f} cores busy) / ({per_image})",
        )
    )
    if t is not None and thread_rate(figures) < cpu_rate(figures):  # the transform waits
        lines.append(
            _row(
                f"{name} on {setup.threads} threads",
                f"{num(thread_rate(figures))} images/s = {setup.threads} / ({_ms(best.cpu_s_per_image)} + "
                f"{_ms(t.wall_s_per_image)} wall): the transform waits, so threads, not cores, bound it",
            )
        )
    return lines


def render(figures: Figures, verdict: Verdict) -> str:
    setup = figures.setup
    lines = [
        f"dataset    {setup.dataset} ({'remote' if setup.remote else 'local'}), channel {setup.channel}, "
        f"rank {setup.rank} of {setup.world_size}, batch {setup.batch_size}, images {setup.image_size} px",
        f"machine    {setup.threads} decode thread{'s' if setup.threads != 1 else ''} of {setup.cores} "
        f"core{'s' if setup.cores != 1 else ''}, {'GPU ' + setup.gpu if setup.gpu else 'no GPU'}, "
        f"loaders._jpeg {'built' if setup.batch_decoder else 'not built'}",
        f"transform  {setup.transform or 'none'}; model {setup.model or 'not measured (no --model)'}",
        "",
        _row("stage", "alone on this machine"),
        _store_row(figures),
        *_cpu_rows(figures),
    ]
    m = figures.model
    if m is not None:
        shape = ", ".join(map(str, m.input_shape))
        lines.append(
            _row(f"model step ({m.device})", f"{num(m.images_per_s)} images/s ({m.steps} steps of [{shape}])")
        )
    g = figures.together
    lines.append(
        _row(
            "together" + (" (loader + model)" if g.with_model else " (loader only)"),
            f"{num(g.images_per_s)} images/s, waited {g.wait_share:.0%} for data "
            f"from the first batch on ({g.batches} batches; the first after {g.first_batch_s:.2f} s)",
        )
    )
    lines += ["", f"bottleneck: {verdict.bottleneck}", f"  {verdict.headline}", f"  {verdict.together}"]
    lines += [f"  note: {n}" for n in verdict.notes]
    lines += ["next steps:"] + [f"  {i}. {s.text} [{s.action}]" for i, s in enumerate(verdict.steps, 1)]
    return "\n".join(lines)
