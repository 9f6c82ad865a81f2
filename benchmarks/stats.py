"""Medians over repetitions and srv/peer ratios."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from benchmarks.results import Run

Key = tuple[str, str, str]   # engine, workload, metric


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing or the peer's is zero."""
    if ours is None or not theirs:
        return None
    return ours / theirs


def repetition_ratios(runs: Iterable[Run], ours: str, theirs: str, workload: str, metric: str,
                      their_workload: str | None = None) -> list[float]:
    """ours / theirs of one metric, repetition by repetition, where both engines completed the
    workload without failed requests (theirs on `their_workload` when given: an engine against
    itself on another workload). A repetition runs the engines minutes apart, so its ratio shares
    one state of the machine; the ratio of two medians may pair one engine's quiet run with the
    other's busy one."""
    their_workload = their_workload or workload
    values: dict[tuple[int, str, str], float] = {}
    for run in runs:
        if run.workload in (workload, their_workload) and run.engine in (ours, theirs) \
                and not run.metrics.get("failed") and run.metrics.get(metric) is not None:
            values[(run.rep, run.engine, run.workload)] = run.metrics[metric]
    reps = sorted({rep for rep, _, _ in values})
    pairs = (ratio(values.get((rep, ours, workload)), values.get((rep, theirs, their_workload))) for rep in reps)
    return [r for r in pairs if r is not None]


def medians(runs: Iterable[Run]) -> dict[Key, float]:
    """The median of each metric of each engine's workload over the repetitions that completed it:
    a run with failed requests says nothing about speed and is left out."""
    samples: dict[Key, list[float]] = defaultdict(list)
    for run in runs:
        if run.metrics.get("failed"):
            continue
        for metric, value in run.metrics.items():
            samples[(run.engine, run.workload, metric)].append(value)
    return {key: value for key, values in samples.items() if (value := median(values)) is not None}
