"""Each stage's rate alone on this machine, from the measured figures (pure functions).

- **store**: the rows/s a ``decoder="none"`` loader yielded (stage 1);
- **decoding and the transform**, sharing the ``--threads`` cores:
  ``min(threads, C) / (d + t)`` images/s, where ``d`` is the decode CPU seconds per image and
  ``C`` the cores the decode threads kept busy (CPU seconds per wall second), both from the
  decode run with the most images/s at up to ``threads`` threads, and ``t`` the transform's CPU
  seconds per image. Without a transform this is that run's measured images/s: the formula
  spends the cores decoding actually got on both costs, so a decoder that does not scale (or
  a machine that others share) caps it. A transform also holds its thread for its wall time
  ``w`` per image (waits included: I/O, a GPU sync, a sleep), so the rate is at most
  ``threads / (d + w)`` (:func:`thread_rate`) as well;
- **model**: the images/s of its SGD step (stage 4).
"""

from __future__ import annotations

from loaders.doctor.figures import DecodeRun, Figures

__all__ = ["best_run", "cpu_rate", "num", "stage_rates", "thread_rate", "transform_s_per_image"]


def num(x: float) -> str:
    """``1,900`` for large figures, three significant digits for small ones."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def best_run(figures: Figures) -> DecodeRun:
    """The decode run with the most images/s among those of at most ``threads`` threads."""
    runs = [r for r in figures.decode.runs if r.threads <= figures.setup.threads] or list(figures.decode.runs)
    return max(runs, key=lambda r: r.images_per_s)


def cpu_rate(figures: Figures) -> float:
    """Images/s decoding and the transform sustain on the ``threads`` cores (module docstring)."""
    best = best_run(figures)
    per_image = best.cpu_s_per_image + (figures.transform.cpu_s_per_image if figures.transform else 0.0)
    if per_image <= 0:
        return best.images_per_s
    return min(figures.setup.threads, best.busy_cores) / per_image


def thread_rate(figures: Figures) -> float:
    """Images/s ``threads`` decode threads give when each holds an image for its decoding's CPU
    time plus the transform's wall time (inf without a transform: decoding waits for nothing)."""
    if figures.transform is None:
        return float("inf")
    per_image = best_run(figures).cpu_s_per_image + figures.transform.wall_s_per_image
    return figures.setup.threads / per_image if per_image > 0 else float("inf")


def transform_s_per_image(figures: Figures) -> float:
    """What the transform costs a thread per image: its CPU time, or its wall time when it
    waits longer than it computes (0 without a transform)."""
    t = figures.transform
    return 0.0 if t is None else max(t.cpu_s_per_image, t.wall_s_per_image)


def stage_rates(figures: Figures) -> dict[str, float]:
    """Rows (images) per second by ``"store"``, ``"decode_transform"`` and, when measured, ``"model"``."""
    rates = {
        "store": figures.store.rows_per_s,
        "decode_transform": min(cpu_rate(figures), thread_rate(figures)),
    }
    if figures.model is not None:
        rates["model"] = figures.model.images_per_s
    return rates
