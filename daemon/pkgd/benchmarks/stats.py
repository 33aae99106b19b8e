"""Summaries of per-request timings, as ``vllm bench`` prints them (torch-free)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

PERCENTILES = ("median", "mean", "p99")


def latency_stats(values: Iterable[float]) -> dict[str, float]:
    """``{"median", "mean", "p99"}`` of ``values`` (seconds), NaN for none. p99 is the value at
    index ``int(0.99 * n)`` of the sorted values (nearest rank, as ``vllm bench serve``)."""
    ordered = sorted(values)
    if not ordered:
        return {name: float("nan") for name in PERCENTILES}
    return {
        "median": statistics.median(ordered),
        "mean": statistics.fmean(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }
