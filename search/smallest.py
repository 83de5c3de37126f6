"""The least device memory any plan in a search space needs: computed, not sampled.

When nothing fits, the user is told what the smallest plan needs. That figure must not depend on
which points a sampler happened to visit, so it is found directly, exactly, for every sampler:

- at one (micro-batch, precision, ZeRO stage) point, the least peak over every checkpoint
  placement is the minimum of the exact placement solver's curve (``planner.memory.placement``: the
  lowest peak for each count of checkpointed blocks, verified against brute force) and, where
  segments are allowed, every uniform segmentation (``search.candidates.segment_plans``);
- over the points, a branch and bound: each point's ``peak_lower_bound`` (what every placement
  of it reaches, found without building the graph) orders them and prunes every point whose
  bound is above the best found; a point that passes is then pruned, without a walk, when what it
  holds at the optimizer step is above the best found (for ``first_fitting``: above the cap), or
  else after one walk (every block checkpointed) on that walk's optimizer step and, without
  segments, its forward, which every placement reaches (``search.candidates.least_memory_at``).
  Micro-batch size is not assumed monotone: without
  accumulation the gradients are absent during the forward, so the largest micro-batch can need
  less memory than a smaller one with accumulation (tests/planner/test_properties.py).

The result equals exhaustive enumeration over the space (tests/search/test_smallest.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hardware.profile import HardwareProfile
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.program.estimate import device_bytes, peak_lower_bound, step_time_s
from search.candidates import least_memory_at
from search.space import SearchSpace


@dataclass(frozen=True)
class Smallest:
    """The plan with the least device memory in a space, and how much of the space was priced."""

    knobs: Knobs
    device_bytes: int
    n_points: int  # (micro-batch, precision, stage) points in the space
    n_priced: int  # points walked in full; the others were pruned by their lower bound


def first_fitting(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    space: SearchSpace,
    cap_bytes: int,
) -> Smallest | None:
    """A plan of ``space`` whose device bytes are at most ``cap_bytes``, or None if none is:
    exact like ``smallest_plan``, but every point whose lower bound is above the cap is skipped
    unwalked, and it stops at the first plan that fits."""
    points = _points(training, space)
    for bound, i in _bounds(model, training, hw, points):
        if bound > cap_bytes:
            return None
        knobs, peak = least_memory_at(model, training, hw, points[i], space.fixed_checkpoint, space.allow_segments,
                                      space.checkpoint_policies, above_bytes=cap_bytes)
        if device_bytes(peak, hw) <= cap_bytes:
            return Smallest(knobs=knobs, device_bytes=device_bytes(peak, hw), n_points=len(points), n_priced=i + 1)
    return None


def _points(training: TrainConfig, space: SearchSpace) -> list[Knobs]:
    return [space.knobs_at(training, point) for point in space.points()]


def _bounds(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, points: list[Knobs]) -> list[tuple[int, int]]:
    """(lower bound of device bytes, index) for every point, smallest first."""
    return sorted((device_bytes(peak_lower_bound(model, training, hw, k), hw), i) for i, k in enumerate(points))


def smallest_plan(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    space: SearchSpace,
) -> Smallest:
    """The least-memory plan of ``space`` (ties: the faster one)."""
    points = _points(training, space)
    best: tuple[int, float, Knobs] | None = None
    priced = 0
    for bound, i in _bounds(model, training, hw, points):
        if best is not None and bound > best[0]:
            break
        knobs, peak = least_memory_at(model, training, hw, points[i], space.fixed_checkpoint, space.allow_segments,
                                      space.checkpoint_policies, above_bytes=None if best is None else best[0])
        priced += 1
        need = device_bytes(peak, hw)
        if best is None or need <= best[0]:
            step_s = step_time_s(model, training, hw, knobs)
            if best is None or (need, step_s) < best[:2]:
                best = (need, step_s, knobs)
    if best is None:
        raise ValueError("an empty search space has no smallest plan")
    return Smallest(knobs=best[2], device_bytes=best[0], n_points=len(points), n_priced=priced)

