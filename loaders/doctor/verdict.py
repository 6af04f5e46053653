"""The verdict: which stage bounds feeding the model, by how much, and what to do next. A pure
function of the measured :class:`~loaders.doctor.figures.Figures`.

Each stage's rate is what it could sustain alone on this machine (:mod:`loaders.doctor.rates`:
the store's rows/s; decoding and the transform, ``min(threads, C) / (d + t)`` images/s on the
``--threads`` cores; the model's step). The lowest is the bottleneck (for decoding and the
transform: ``"transform"`` when its cost per image ``t`` (CPU, or wall time when it waits
longer) exceeds decoding's ``d``, else
``"decode"``); the ratio is the next-lowest rate over it; the next steps are that stage's
(:mod:`loaders.doctor.next_steps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loaders.doctor.figures import Figures
from loaders.doctor.next_steps import SCALES, STEPS, Step, split_cores
from loaders.doctor.rates import best_run, num, stage_rates, transform_s_per_image

__all__ = ["CLOSE", "STAGES", "Verdict", "decide"]

#: The names a verdict's ``bottleneck`` takes.
STAGES = ("store", "decode", "transform", "model")
#: Below this ratio the next stage is close behind: removing the bottleneck gains little.
CLOSE = 1.25


@dataclass(frozen=True, slots=True)
class Verdict:
    """``rates``: images (rows) per second each stage could sustain alone, by ``"store"``,
    ``"decode_transform"`` and ``"model"`` (when measured); ``next_stage`` is the key of the
    next-lowest rate and ``ratio`` its rate over the bottleneck's; ``together_share``: the
    together rate over the bottleneck's."""

    bottleneck: str
    rates: dict[str, float]
    next_stage: str
    ratio: float
    headline: str
    together: str
    together_share: float
    steps: tuple[Step, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a ratio over a rate of 0 is ``null``."""
        return {
            "bottleneck": self.bottleneck,
            "rates": self.rates,
            "next_stage": self.next_stage,
            "ratio": self.ratio if math.isfinite(self.ratio) else None,
            "headline": self.headline,
            "together": self.together,
            "together_share": self.together_share,
            "next_steps": [{"action": s.action, "text": s.text} for s in self.steps],
            "notes": list(self.notes),
        }


def decide(figures: Figures) -> Verdict:
    """The bottleneck of ``figures``, its ratio to the next stage, the together rate against it,
    and the next steps."""
    rates = stage_rates(figures)
    order = sorted(rates, key=lambda k: rates[k])
    low, nxt = order[0], order[1]
    ratio = rates[nxt] / rates[low] if rates[low] > 0 else math.inf
    d = best_run(figures).cpu_s_per_image
    t = transform_s_per_image(figures)
    bottleneck = low if low != "decode_transform" else ("transform" if t > d else "decode")

    headline = (
        f"{_name(figures, low)} ({_rate_text(figures, low, rates[low])}) {_bound(low, figures)} training: "
    )
    headline += f"{_could(figures, nxt)} {num(rates[nxt])} {_unit(nxt)}, {ratio:.1f}x more"
    notes = []
    if ratio < CLOSE:
        notes.append(
            f"{_name(figures, nxt)} {'are' if _bound(nxt, figures) == 'bound' else 'is'} close behind "
            f"({ratio:.2f}x): removing this bottleneck alone gains at most that"
        )
    if figures.model is None:
        notes.append("no --model: the model's step was not measured; this verdict is about the data alone")
    g = figures.together
    share = g.images_per_s / rates[low] if rates[low] > 0 else 0.0
    together = f"together: {num(g.images_per_s)} images/s, {share:.0%} of the bottleneck's {num(rates[low])}"
    if g.with_model:
        together += f"; the loop waited for data {g.wait_share:.0%} of the time"
    else:
        together += " (a loop that only takes the batches: it waits for data all the time)"
    notes += _together_notes(figures, bottleneck, share)
    if bottleneck in ("decode", "transform") and len(figures.decode.runs) > 1:
        last = figures.decode.runs[-1]
        efficiency = figures.decode.efficiency(last)
        if efficiency < SCALES:
            notes.append(
                f"decoding scaled poorly: {efficiency:.0%} per-thread efficiency at {last.threads} threads "
                f"({last.busy_cores:.1f} cores busy); other work on this machine takes cores too"
            )
    steps = STEPS[bottleneck](figures, rates, ratio, nxt)
    if share < 0.5 and figures.model is not None and figures.model.device == "cpu":
        steps.append(split_cores(figures, share))
    return Verdict(bottleneck, rates, nxt, ratio, headline, together, share, tuple(steps), tuple(notes))


def _name(figures: Figures, key: str) -> str:
    if key == "store":
        return "the store"
    if key == "model":
        return "the model"
    return "decoding and the transform" if figures.transform is not None else "decoding"


def _bound(key: str, figures: Figures) -> str:
    return "bound" if key == "decode_transform" and figures.transform is not None else "bounds"


def _rate_text(figures: Figures, key: str, rate: float) -> str:
    setup = figures.setup
    if key == "store":
        where = "local disk"
        if setup.remote:
            where = "remote, from the local cache" if figures.store.cached else "remote"
        return f"{num(rate)} rows/s, {where}"
    if key == "model":
        return f"{num(rate)} images/s on {figures.model.device if figures.model else '?'}"
    return f"{num(rate)} images/s on {setup.threads} core{'s' if setup.threads != 1 else ''}"


def _could(figures: Figures, key: str) -> str:
    if key == "store":
        return "the store could give"
    if key == "model":
        return "the model could take"
    return f"{_name(figures, key)} could keep up with"


def _unit(key: str) -> str:
    return "rows/s" if key == "store" else "images/s"


def _together_notes(figures: Figures, bottleneck: str, share: float) -> list[str]:
    g, model = figures.together, figures.model
    notes = []
    shared_cpu = model is not None and model.device == "cpu"
    if share < 0.5:
        why = (
            "the model's step runs on the same CPU cores as the decode threads"
            if shared_cpu
            else "the loader's threads got less of the machine than each stage alone (other load here, or "
            "a transform whose torch ops fan out to torch's intra-op threads on top of the decode threads)"
        )
        notes.append(f"together runs at {share:.0%} of the slowest stage alone: {why}")
    if bottleneck == "model" and g.with_model and g.wait_share > 0.3:
        notes.append(
            f"the model is the slowest stage, yet the loop waited {g.wait_share:.0%} for data: "
            + (
                "the model and decoding compete for the CPU"
                if shared_cpu
                else "the loader falls behind in bursts"
            )
        )
    return notes
