"""The least device memory any plan in a search space needs: computed, not sampled.

When nothing fits, the user is told what the smallest plan needs. That figure must not depend on
which points a sampler happened to visit, so it is found directly, exactly, for every sampler:

- at one (micro-batch, precision, ZeRO stage) point, the least peak over every checkpoint
  placement is the minimum of the exact placement solver's curve (``planner.memory.placement``: the
  lowest peak for each count of checkpointed blocks, verified against brute force) and, where
  segments are allowed, every uniform segmentation (``search.candidates.segment_plans``);
- over the points, a branch and bound: each point's ``peak_lower_bound`` (what every placement
  of it reaches, found without building the graph) orders them and prunes every point whose
  bound is above the best found; a point that passes is then pruned without a graph when what its
  layout holds at the optimizer step (``search.bounds.step_floor_bound``: parameter sizes alone)
  is above the best found (for ``first_fitting``: above the cap), else without a walk on the exact
  figure (``search.bounds.static_floor_at``: one graph per layout, shared by its micro-batches),
  or else after one walk (every block checkpointed) on that walk's optimizer step and, without
  segments, its forward, which every placement reaches (``search.candidates.least_memory_at``).
  Micro-batch size is not assumed monotone: without
  accumulation the gradients are absent during the forward, so the largest micro-batch can need
  less memory than a smaller one with accumulation (tests/planner/test_properties.py).

Ties go to the smaller micro-batch, then to the faster plan. Where the optimizer step is the peak
(the foreach optimizer's temporaries on a large model), every micro-batch of a layout needs the
same least memory: a tie between micro-batches is then settled by the bounds above alone, where
"the faster" would need every one of them solved and timed (DeepSeek-V3 on 8 GPUs: some 70 points,
a minute). The smallest micro-batch is also the usual least-memory answer, the one that needs the
least checkpointing to get there.

The result equals exhaustive enumeration over the space (tests/search/test_smallest.py; the tie
rule: tests/search/test_bounds.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hardware.profile import HardwareProfile
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.program.estimate import device_bytes, peak_lower_bound, step_time_s
from search.bounds import step_floor_bound
from search.candidates import least_memory_at
from search.space import SearchSpace


@dataclass(frozen=True)
class Smallest:
    """The plan with the least device memory in a space, and how much of the space was priced."""

    knobs: Knobs
    device_bytes: int
    n_points: int  # (micro-batch, precision, stage) points in the space
    n_priced: int  # points solved (least_memory_at); the others were pruned by a lower bound without one


def first_fitting(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    space: SearchSpace,
    cap_bytes: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> Smallest | None:
    """A plan of ``space`` whose device bytes are at most ``cap_bytes``, or None if none is:
    exact like ``smallest_plan``, but every point whose lower bound is above the cap is skipped
    unwalked, and it stops at the first plan that fits (in the order of ``peak_lower_bound``).
    ``on_progress(done, points)`` follows the points as each is tried."""
    every = _points(training, space)
    points = [k for k in every if _step_floor(model, training, hw, k) <= cap_bytes]  # whole layouts, no graph
    priced = 0
    order = _bounds(model, training, hw, points)
    for done, (bound, i) in enumerate(order):
        if on_progress is not None:
            on_progress(done, len(order))
        if bound > cap_bytes:
            return None
        knobs, peak = least_memory_at(model, training, hw, points[i], space.fixed_checkpoint, space.allow_segments,
                                      space.checkpoint_policies, above_bytes=cap_bytes)
        priced += 1
        if device_bytes(peak, hw) <= cap_bytes:
            return Smallest(knobs=knobs, device_bytes=device_bytes(peak, hw), n_points=len(every), n_priced=priced)
    return None


def _points(training: TrainConfig, space: SearchSpace) -> list[Knobs]:
    return [space.knobs_at(training, point) for point in space.points()]


def _step_floor(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> int:
    """Device bytes of ``step_floor_bound``: what every placement of ``knobs`` needs at least (no
    graph; one figure per layout)."""
    return device_bytes(step_floor_bound(model, training, hw, knobs), hw)


def _bounds(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, points: list[Knobs]) -> list[tuple[int, int]]:
    """(lower bound of device bytes, index) for every point, smallest first."""
    return sorted((device_bytes(peak_lower_bound(model, training, hw, k), hw), i) for i, k in enumerate(points))


@dataclass
class _Best:
    """The smallest plan so far: its device bytes, micro-batch and knobs (its step time once asked)."""

    need: int
    micro_batch: int
    knobs: Knobs
    step_s: float | None = None

    def threshold(self, knobs: Knobs) -> int:
        """The most device bytes a plan of ``knobs``' point may need to beat this one: as many at a
        micro-batch no larger (a tie goes to the smaller micro-batch, then the faster), fewer at a
        larger one."""
        return self.need if knobs.micro_batch_size <= self.micro_batch else self.need - 1


def smallest_plan(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    space: SearchSpace,
    on_progress: Callable[[int, int], None] | None = None,
) -> Smallest:
    """The least-memory plan of ``space``; ties go to the smaller micro-batch, then the faster plan
    (each point's own plan: its first policy and fewest checkpointed blocks reaching its least).
    ``on_progress(done, points)`` follows the points in the order they are bounded."""
    points = _points(training, space)
    best: _Best | None = None
    priced = 0
    order = _bounds(model, training, hw, points)
    for done, (bound, i) in enumerate(order):
        if on_progress is not None:
            on_progress(done, len(order))
        if best is not None and bound > best.need:
            break
        knobs = points[i]
        above = None if best is None else best.threshold(knobs)
        if above is not None and (bound > above or _step_floor(model, training, hw, knobs) > above):
            continue  # cannot need as little as the plan found: skipped without a graph
        knobs, peak = least_memory_at(model, training, hw, knobs, space.fixed_checkpoint, space.allow_segments,
                                      space.checkpoint_policies, above_bytes=above)
        priced += 1
        need = device_bytes(peak, hw)
        if above is not None and need > above:
            continue
        if best is None or need < best.need or knobs.micro_batch_size < best.micro_batch:
            best = _Best(need=need, micro_batch=knobs.micro_batch_size, knobs=knobs)
            continue
        if best.step_s is None:  # a tie at the same micro-batch: the faster plan
            best.step_s = step_time_s(model, training, hw, best.knobs)
        step_s = step_time_s(model, training, hw, knobs)
        if step_s < best.step_s:
            best = _Best(need=need, micro_batch=knobs.micro_batch_size, knobs=knobs, step_s=step_s)
    if on_progress is not None:
        on_progress(len(order), len(order))
    if best is None:
        raise ValueError("an empty search space has no smallest plan")
    return Smallest(knobs=best.knobs, device_bytes=best.need, n_points=len(points), n_priced=priced)
