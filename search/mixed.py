"""Plans that checkpoint some blocks with one policy and some with another.

Whole-block checkpointing frees the most memory per block and re-runs the most; per-op
checkpointing keeps the matmul outputs, re-runs the cheap ops and frees less. Between "every block
per op" (too big) and "k blocks whole" (slow) a plan with a blocks whole and b per op can fit and
be faster than both. ``planner.memory.placement_mixed`` gives, for every pair of counts (a, b), the
placement with the lowest peak, exactly; a step's time is additive in what each checkpointed
block re-runs under its policy, so each count pair has one step time. Only pairs that no other
pair beats on both time and memory become plans.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.memory.placement import NotDecomposableError, PlacementProfile
from planner.memory.placement_mixed import MixedProfile
from planner.plan.checkpointing import CheckpointPolicy
from planner.plan.knobs import Knobs
from planner.program.estimate import device_bytes
from planner.program.results import ParetoPoint
from planner.program.step_program import StepProgram
from planner.timing.op_times import TimeBreakdown


def mixed_points(
    profiles: dict[CheckpointPolicy, PlacementProfile], rerun_s: dict[CheckpointPolicy, Sequence[float]],
    single: Sequence[tuple[float, int]], cap_bytes: int, program: StepProgram, base: Knobs,
    no_recompute: TimeBreakdown,
) -> list[ParetoPoint]:
    """Plans mixing two of ``profiles``' policies, at least one block each (one policy alone is
    the single-policy search's), that fit ``cap_bytes`` and are faster than every single-policy
    plan that fits (``single``: step time before communication, peak bytes), each with less
    memory than every faster mix. ``rerun_s[policy][block]``: the forward time the block's
    recompute takes under that policy, backward passes included; ``program``: the point's step
    program, which places each mix's collectives."""
    fitting = [t for t, peak in single if device_bytes(peak, program.hw) <= cap_bytes]
    if not fitting:
        return []
    budget_s = min(fitting) - no_recompute.step_time_s  # the recompute a mix must stay under
    order = [p for p in CheckpointPolicy if p in profiles]
    points: list[ParetoPoint] = []
    for i, first in enumerate(order):
        for second in order[i + 1:]:
            try:
                mixed = MixedProfile(profiles[first], profiles[second])
            except NotDecomposableError:
                continue
            points += _pair_points(mixed, (first, second), rerun_s, budget_s, cap_bytes, program, base,
                                   no_recompute)
    return points


def _pair_points(
    mixed: MixedProfile, pair: tuple[CheckpointPolicy, CheckpointPolicy],
    rerun_s: dict[CheckpointPolicy, Sequence[float]], budget_s: float, cap_bytes: int, program: StepProgram,
    base: Knobs, no_recompute: TimeBreakdown,
) -> list[ParetoPoint]:
    hw = program.hw
    n = mixed.a.n_blocks
    mean = [sum(rerun_s[p]) / n for p in pair]  # the blocks are alike: each one's recompute the same
    if min(mean) <= 0 or mean[0] + mean[1] >= budget_s:
        return []
    # counts a mix within the budget can have: the solver runs on these only
    most = [min(n - 1, math.ceil(budget_s / m)) for m in mean]
    best, choices = mixed.min_peak_by_counts(most[0], most[1])
    states = sorted((a * mean[0] + b * mean[1], best[a][b], a, b) for a in range(1, most[0] + 1)
                    for b in range(1, most[1] + 1)
                    if best[a][b] != math.inf and a * mean[0] + b * mean[1] < budget_s
                    and device_bytes(int(best[a][b]), hw) <= cap_bytes)
    points = []
    lowest = math.inf
    for _, peak, a, b in states:  # by time: keep a mix with less memory than every faster one
        if peak >= lowest:
            continue
        lowest = peak
        statuses = mixed.placement(choices, a, b)
        rerun = sum(rerun_s[pair[s - 1]][i] for i, s in enumerate(statuses) if s)
        blocks = tuple(i for i, s in enumerate(statuses) if s)
        time = no_recompute.model_copy(update={"recompute_s": rerun, "step_time_s": no_recompute.step_time_s + rerun})
        knobs = base.model_copy(update={
            "checkpoint_blocks": blocks, "checkpoint_policy": pair[0],
            "block_policies": tuple((i, pair[1]) for i, s in enumerate(statuses) if s == 2)})
        step_s = program.placed(time).step_time_s
        points.append(ParetoPoint(step_time_s=step_s, device_bytes=device_bytes(int(peak), hw), knobs=knobs))
    return points
