"""Price one pipeline-parallel point: checkpoint placement per pipeline rank.

Each pipeline rank walks only its own stages' blocks, so ranks are placed independently: every
rank checkpoints the fewest blocks that bring its own peak under the cap (the first ``k`` blocks
of each of its stages, whole-block policy), found by bisection on ``k`` over that rank's walk.
The first ranks hold the most micro-batches in flight (1F1B: ``pp - r``), so they checkpoint more
than the last, as Megatron and torchtitan users tune by hand. Fewer checkpointed blocks on a
rank never make the step slower (each stage's time only grows with its recompute), so the
per-rank least is the fastest placement of this family. The step time is the pipeline's
(``planner.program.estimate.step_time_s``); the device bytes the busiest rank's.
"""

from __future__ import annotations

import math

from hardware.profile import HardwareProfile
from planner.memory.step import checkpoint_units
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.checkpointing import CheckpointPolicy
from planner.plan.knobs import Knobs
from planner.plan.pipeline_plan import SPLIT_BACKWARD
from planner.program.estimate import device_bytes, peak_lower_bound, step_program, step_time_s
from planner.program.results import ParetoPoint
from planner.program.step_program import StepProgram

__all__ = ["least_memory_pipelined", "pipelined_placement"]


def _first_blocks(program: StepProgram, counts: tuple[int, ...]) -> tuple[int, ...]:
    """The global blocks checkpointed when rank ``r`` checkpoints the first ``counts[r]`` blocks of
    each of its stages."""
    out: list[int] = []
    for rank, k in zip(program.ranks, counts, strict=True):
        for span in rank.spans:
            out += range(span.first_block, span.first_block + min(k, span.n_blocks))
    return tuple(sorted(out))


class _RankPeaks:
    """Each rank's peak at ``k`` checkpointed blocks per stage, walked once per (rank, k)."""

    def __init__(self, model: ModelConfig, program: StepProgram, knobs: Knobs) -> None:
        self.model, self.program, self.knobs = model, program, knobs
        self.cache: dict[tuple[int, int], int] = {}

    def __call__(self, rank: int, k: int) -> int:
        if (rank, k) not in self.cache:
            program = self.program
            counts = tuple(k if r == rank else 0 for r in range(len(program.ranks)))
            units = checkpoint_units(self.model.n_layers, _first_blocks(program, counts), (),
                                     self.knobs.checkpoint_policy, self.knobs.save_list)
            self.cache[(rank, k)] = program.walk(units, rank=program.ranks[rank]).peak.bytes
        return self.cache[(rank, k)]

    def most(self, rank: int) -> int:
        """The most blocks per stage the rank can checkpoint (its longest stage's; none under a
        split-backward schedule, which is not modelled with checkpointing)."""
        if self.knobs.pp_schedule in SPLIT_BACKWARD:
            return 0
        return max(s.n_blocks for s in self.program.ranks[rank].spans)


def _policy(policies: tuple[CheckpointPolicy, ...]) -> CheckpointPolicy:
    return CheckpointPolicy.FULL if CheckpointPolicy.FULL in policies else policies[0]


def pipelined_placement(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap_bytes: int, base: Knobs,
                        policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,),
                        prune: bool = True,
                        beat: tuple[float, int] | None = None) -> tuple[ParetoPoint, tuple[ParetoPoint, ...], bool]:
    """The fastest placement of ``base`` (a pipeline point, nothing checkpointed) whose busiest
    rank fits ``cap_bytes``, or the one with every block checkpointed when none fits; with the
    plans priced on the way and whether only a lower bound was priced (``prune``: the point's
    ``peak_lower_bound`` is above the cap, or ``beat``, the step time of the last runner-up found
    so far, is faster than this point without any recompute: it can be neither the fastest plan nor
    a runner-up, and the Pareto front goes without its smaller-memory plans)."""
    knobs = base.model_copy(update={"checkpoint_policy": _policy(policies), "checkpoint_blocks": ()})
    if prune:
        floor = device_bytes(peak_lower_bound(model, training, hw, base), hw)
        if floor > cap_bytes:
            return ParetoPoint(step_time_s=math.inf, device_bytes=floor, knobs=base), (), True
        if beat is not None:  # a pipeline point slower than a plan found, even without recompute, is not walked
            fastest = step_time_s(model, training, hw, knobs)  # no walk: what every placement takes at least
            if fastest > beat[0]:
                return ParetoPoint(step_time_s=fastest, device_bytes=floor, knobs=knobs), (), True
    program = step_program(model, training, hw, knobs)
    peaks = _RankPeaks(model, program, knobs)
    ranks = range(len(program.ranks))
    counts = [0] * len(ranks)
    guess: int | None = None
    # the first rank (most micro-batches in flight) and the last (the logits) first; a middle rank
    # holds no more than the one before it, so it starts from that rank's count
    for r in (0, len(ranks) - 1, *range(1, len(ranks) - 1)) if len(ranks) > 1 else (0,):
        found = _fewest(peaks, r, hw, cap_bytes, guess if 0 < r < len(ranks) - 1 else None)
        if found is None and prune:  # this rank cannot fit: nor can the point (its least need is a bound)
            need = device_bytes(peaks(r, peaks.most(r)), hw)
            return ParetoPoint(step_time_s=math.inf, device_bytes=need, knobs=base), (), True
        counts[r] = peaks.most(r) if found is None else found
        guess = counts[r] if r < len(ranks) - 1 else guess
    fits = all(device_bytes(peaks(r, counts[r]), hw) <= cap_bytes for r in ranks)
    if not fits:  # the least memory: every block checkpointed on every rank
        counts = [peaks.most(r) for r in ranks]
    placed = knobs.model_copy(update={"checkpoint_blocks": _first_blocks(program, tuple(counts))})
    need = max(device_bytes(peaks(r, counts[r]), hw) for r in ranks)
    chosen = ParetoPoint(step_time_s=step_time_s(model, training, hw, placed), device_bytes=need, knobs=placed)
    points = [chosen]
    if any(counts):  # nothing checkpointed: the fastest, whatever it needs
        plain = max(device_bytes(peaks(r, 0), hw) for r in ranks)
        points.append(ParetoPoint(step_time_s=step_time_s(model, training, hw, knobs), device_bytes=plain, knobs=knobs))
    return chosen, tuple(points), False


def _fewest(peaks: _RankPeaks, r: int, hw: HardwareProfile, cap_bytes: int, guess: int | None) -> int | None:
    """The fewest blocks per stage rank ``r`` checkpoints to fit (None: not even every block):
    nothing, else down from ``guess`` when it fits, else by bisection (peaks fall as more blocks
    are checkpointed)."""
    def fits(k: int) -> bool:
        return device_bytes(peaks(r, k), hw) <= cap_bytes

    most = peaks.most(r)
    guess = None if guess is None else min(guess, most)  # the rank before may hold longer stages
    if fits(0):  # nothing needed: one walk
        return 0
    if most == 0:  # nothing to place (a split-backward schedule)
        return None
    if guess is not None and 0 < guess <= most and fits(guess):
        k = guess
        while k > 1 and fits(k - 1):
            k -= 1
        return k
    lo, hi = 1 if guess is None else max(1, guess + 1), most
    if not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def least_memory_pipelined(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, base: Knobs,
                           policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,)) -> tuple[Knobs, int]:
    """The placement of a pipeline point with the least peak on its busiest rank (every block
    checkpointed, unless nothing checkpointed already needs no more), and that peak."""
    knobs = base.model_copy(update={"checkpoint_policy": _policy(policies), "checkpoint_blocks": ()})
    program = step_program(model, training, hw, knobs)
    peaks = _RankPeaks(model, program, knobs)
    ranks = range(len(program.ranks))
    every = max(peaks(r, peaks.most(r)) for r in ranks)
    plain = max(peaks(r, 0) for r in ranks)
    if plain <= every:
        return knobs, plain
    counts = tuple(peaks.most(r) for r in ranks)
    return knobs.model_copy(update={"checkpoint_blocks": _first_blocks(program, counts)}), every
