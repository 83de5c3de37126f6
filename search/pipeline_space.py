"""The pipeline part of the search space: which schedules a space tries, and the one-line
refusal of a fixed ``--pp`` that no point of the space could run (``search.space`` builds the
space; ``planner.plan.pipeline_plan.check_modelled`` holds torch's rules)."""

from __future__ import annotations

from planner.errors import ConfigError
from planner.plan.pipeline_plan import check_modelled
from planner.plan.pipeline_schedules import SINGLE_STAGE, PipelineSchedule

# the pipeline schedules tried where --pp-schedule is left out: 1F1B, and Interleaved1F1B at two stages
# per rank (its bubble (p-1)/(2m) for a few more micro-batches in flight). GPipe and LoopedBFS hold
# every micro-batch at once for the same bubble; the zero-bubble schedules are refused with
# checkpointing (planner.plan.pipeline_plan.check_modelled) and fixed only on request
SEARCHED_SCHEDULES = (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B)


def searched_schedules(pps: tuple[int, ...], fixed: PipelineSchedule | None,
                       virtual: int | None) -> tuple[PipelineSchedule, ...]:
    """The schedules a space tries: none without a pipeline degree above 1, the one fixed, or
    ``SEARCHED_SCHEDULES`` (only the looped one when ``--pp-virtual`` asks for several stages per rank)."""
    if pps == (1,):
        return ()
    if fixed is not None:
        return (fixed,)
    if virtual is not None and virtual > 1:
        return tuple(s for s in SEARCHED_SCHEDULES if s not in SINGLE_STAGE)
    if virtual == 1:  # one stage per rank: the looped schedule would be 1F1B's twin
        return tuple(s for s in SEARCHED_SCHEDULES if s in SINGLE_STAGE)
    return SEARCHED_SCHEDULES


def check_fixed_pipeline(n_layers: int, pp: int, layers: tuple[int, ...],
                         runs: tuple[tuple[PipelineSchedule, int], ...], most_micro_batches: int,
                         checkpointing: bool) -> None:
    """With ``--pp`` fixed, refuse in one line what no point could run: every schedule of ``runs``
    (with its stages per rank) refused by torch at the most micro-batches any point gives it,
    stages the blocks cannot fill, a ``--pp-layers`` that does not fit, or a split-backward
    schedule with fixed checkpointing (the first schedule's reason)."""
    refusals = []
    for schedule, virtual in runs:
        try:
            check_modelled(schedule, pp, most_micro_batches, n_layers, layers, virtual, checkpointing=checkpointing)
        except ConfigError as error:
            refusals.append(error)
    if runs and len(refusals) == len(runs):
        raise refusals[0]
