"""Pass 5 of the manifest job, on the workers: the groups of identical accepted content (staged
by :func:`jobs.manifest_steps.passes.class_task`), counted and a few shown; what
``_manifest.json`` says under ``duplicates``. Runs only when pass 3 found such groups."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jobs.manifest_steps.catalog import same_content
from jobs.manifest_steps.listing import StagedRow
from jobs.manifest_steps.passes import EXAMPLES, PassPlan, read_staged
from lakeshard.format import DuplicatesSummary

__all__ = ["DuplicateGroups", "Duplicates", "duplicates_task"]


@dataclass(frozen=True, slots=True)
class DuplicateGroups:
    """What :func:`duplicates_task` hands back for its content buckets, merged by :meth:`merge`:
    the groups of identical accepted content, their objects, the groups that span channels
    (leakage) and labels; the first groups by first key (``{key: channel}``), of those that span
    channels and of all."""

    groups: int
    objects: int
    across_channels: int
    across_labels: int
    leak_examples: tuple[dict[str, str], ...]
    group_examples: tuple[dict[str, str], ...]

    @classmethod
    def merge(cls, parts: Sequence[DuplicateGroups]) -> DuplicateGroups:
        def first(examples: Iterable[dict[str, str]]) -> tuple[dict[str, str], ...]:
            return tuple(sorted(examples, key=lambda e: next(iter(e)))[:EXAMPLES])

        return cls(
            groups=sum(p.groups for p in parts),
            objects=sum(p.objects for p in parts),
            across_channels=sum(p.across_channels for p in parts),
            across_labels=sum(p.across_labels for p in parts),
            leak_examples=first(e for p in parts for e in p.leak_examples),
            group_examples=first(e for p in parts for e in p.group_examples),
        )


def duplicates_task(buckets: list[int], *, plan: PassPlan) -> list[DuplicateGroups]:
    """The groups of identical accepted content in ``buckets``: counts, and the first
    :data:`EXAMPLES` groups by first key, of all and of those that span channels."""
    out = []
    for bucket in buckets:
        groups = same_content(read_staged(plan.folder("duplicates", bucket)))
        leaks = [g for g in groups if len({r["channel"] for r in g}) > 1]

        def examples(gs: list[list[StagedRow]]) -> tuple[dict[str, str], ...]:
            first = sorted(gs, key=lambda g: g[0]["key"])[:EXAMPLES]
            return tuple({r["key"]: r["channel"] for r in g} for g in first)

        out.append(
            DuplicateGroups(
                groups=len(groups),
                objects=sum(len(g) for g in groups),
                across_channels=len(leaks),
                across_labels=sum(len({r["label"] for r in g}) > 1 for g in groups),
                leak_examples=examples(leaks),
                group_examples=examples(groups),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Duplicates:
    """The manifest's accepted objects of identical content (:class:`DuplicateGroups`, merged),
    and how many ``--dedupe`` rejected: what ``_manifest.json`` says under ``duplicates``."""

    found: DuplicateGroups
    removed: int

    @property
    def examples(self) -> tuple[dict[str, str], ...]:
        """The first groups that span channels, else the first groups."""
        return self.found.leak_examples or self.found.group_examples

    def summary(self) -> DuplicatesSummary:
        f = self.found
        return DuplicatesSummary(
            groups=f.groups,
            objects=f.objects,
            across_channels=f.across_channels,
            across_labels=f.across_labels,
            examples=list(self.examples),
            removed=self.removed,
        )
