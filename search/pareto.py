"""The Pareto front of step time vs device memory."""

from __future__ import annotations

from collections.abc import Iterable

from planner.program.results import ParetoPoint


def non_dominated(points: Iterable[ParetoPoint]) -> list[ParetoPoint]:
    """Plans no other plan beats on both step time and device bytes (fastest first)."""
    front: list[ParetoPoint] = []
    smallest = None
    for point in sorted(points, key=lambda p: (p.step_time_s, p.device_bytes)):
        if smallest is None or point.device_bytes < smallest:
            front.append(point)
            smallest = point.device_bytes
    return front
