"""A plan's pipeline: its stages (which blocks each runs) and each rank's step as a schedule of
(micro-batch, phase) events, from torch's order of actions (``planner.plan.pipeline_schedules``).

How the knobs map onto ``torch.distributed.pipelining`` (as torchtitan drives it): a data-parallel
rank's share of the global batch is ``micro_batch_size x grad_accum_steps`` sequences, and the
pipeline runs it as ``n_microbatches = grad_accum_steps`` micro-batches of ``micro_batch_size``
(torchtitan's ``pipeline_parallel_microbatch_size``) in one ``schedule.step`` per optimizer step:
the accumulation is the pipeline's micro-batches, not an outer loop.

Gradients: every backward adds into the stage's ``.grad``; under DDP only the last backward of
the step reduces them (``PipelineStage.backward_maybe_with_nosync`` runs the others under
``no_sync``), as plain accumulation does.

Every schedule of torch 2.13 is walked: whole forwards and backwards, one or several stages per
rank, and backwards split into input and weight gradients (the zero-bubble schedules, ZBV,
DualPipeV, whose overlapped pairs run one part after the other).
"""

from __future__ import annotations

from dataclasses import replace

from planner.errors import ConfigError
from planner.graph.stages import StageSpan, even_spans, spans_of
from planner.plan.pipeline_orders import Action, ActionKind
from planner.plan.pipeline_schedules import SINGLE_STAGE, PipelineSchedule, check_pipeline, rank_actions, rank_stages
from planner.plan.schedule import BackwardPart, Event, Phase, Schedule

# every schedule's actions are walked: whole forwards and backwards, and a backward split into its
# input half (I) and weight half (W); DualPipeV's overlapped pair runs its two parts one after the
# other, as torch runs it unless a custom function is registered
MODELLED_SCHEDULES = tuple(PipelineSchedule)


SPLIT_BACKWARD = frozenset({PipelineSchedule.INTERLEAVED_ZERO_BUBBLE, PipelineSchedule.ZBV_ZERO_BUBBLE,
                            PipelineSchedule.DUALPIPEV})


def check_modelled(schedule: PipelineSchedule, pp: int, n_micro_batches: int, n_blocks: int,
                   layers_per_stage: tuple[int, ...] = (), virtual: int = 1, checkpointing: bool = False) -> None:
    """Refuse, in one line naming the field, a pipeline torch would refuse (``check_pipeline``), a
    combination not modelled yet, or a split that does not cover the blocks."""
    check_pipeline(schedule, pp, n_micro_batches, virtual, n_blocks)
    if checkpointing and schedule in SPLIT_BACKWARD:
        raise ConfigError(f"pp_schedule: {schedule.value} splits each backward, and what its input half keeps of "
                          "a checkpointed block's recompute until the weight half was not measured; use --checkpoint "
                          "none, or 1f1b / interleaved-1f1b with checkpointing")
    stages = pp * virtual
    if layers_per_stage:
        if len(layers_per_stage) != stages or sum(layers_per_stage) != n_blocks or min(layers_per_stage) < 1:
            given = ",".join(map(str, layers_per_stage))
            raise ConfigError(f"pp_layers: {given} must give {stages} stages of at least one block each, "
                              f"{n_blocks} blocks in all; or leave it out for an even split")


def stage_spans(n_stages: int, n_blocks: int, layers_per_stage: tuple[int, ...] = ()) -> tuple[StageSpan, ...]:
    """Each stage's blocks: the given split, else the even one (earlier stages one block longer)."""
    return spans_of(layers_per_stage) if layers_per_stage else even_spans(n_blocks, n_stages)


# schedules whose micro-batches in flight are bounded (by pp and v, not m): their steady state
# repeats, so a rank's walk over ``walked_micro_batches`` of them peaks where the whole step does
# (tests/planner/test_pipeline_walk.py checks the peaks equal, every rank, against the full walk);
# GPipe and LoopedBFS hold every micro-batch at once, and the zero-bubble schedules' deferred weight
# halves peak later in longer steps (checked: their short walk read lower): those are walked whole
BOUNDED = frozenset({PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.DUALPIPEV})


def walked_micro_batches(schedule: PipelineSchedule, pp: int, n_micro_batches: int, virtual: int = 1) -> int:
    """How many micro-batches a rank's memory walk visits: all of them, or for a bounded schedule
    its warm-up, steady state and cool-down over ``2 pp + 2`` of them (1F1B) or ``pp (v + 1)`` (the
    looped and V ones, whose steady state comes in rounds of ``pp``), the rest counted on one
    steady-state micro-batch (``Event.repeats``)."""
    if schedule not in BOUNDED:
        return n_micro_batches
    # 1F1B: warm-up (pp - r - 1 forwards), a steady state of period one and cool-down; the looped
    # and V schedules run their steady state in rounds of pp micro-batches
    walked = 2 * pp + 2 if schedule is PipelineSchedule.ONE_F_ONE_B else pp * (virtual + 1)
    return n_micro_batches if n_micro_batches <= walked + pp else walked


def rank_schedule(schedule: PipelineSchedule, pp: int, n_micro_batches: int, rank: int,
                  sync_last: bool, virtual: int = 1) -> Schedule:
    """Pipeline rank ``rank``'s step as events, in torch's order, then the optimizer step; each
    event names which of the rank's stages runs it (``rank_stages``: ascending). A split backward
    is two events (``BackwardPart``), except on the first stage, which has no input gradient: its
    ``I`` does nothing and its ``W`` runs the whole backward (``stage.py``
    ``backward_one_chunk``, ``docs/pipeline_memory.md`` section 4). ``sync_last``: a stage reduces
    its gradients on its last backward only (DDP's ``no_sync`` on the others); otherwise every
    backward does. A bounded schedule's long step is walked over ``walked_micro_batches`` of its
    micro-batches, the others counted on the middle one's events (``Event.repeats``)."""
    walked = walked_micro_batches(schedule, pp, n_micro_batches, virtual)
    actions = [c for a in rank_actions(schedule, pp, walked, virtual)[rank] for c in a.computations()]
    local = {stage: i for i, stage in enumerate(rank_stages(schedule, pp, virtual)[rank])}
    events = [e for a in actions for e in _events(a, local[a.stage])]
    last = {e.stage: i for i, e in enumerate(events) if e.phase is Phase.BACKWARD and e.part is not BackwardPart.INPUT}
    events = [replace(e, sync=not sync_last or i == last[e.stage]) if e.phase is Phase.BACKWARD else e
              for i, e in enumerate(events)]
    if walked < n_micro_batches:  # the middle micro-batch stands for those not walked
        middle, extra = walked // 2, n_micro_batches - walked
        events = [replace(e, repeats=1 + extra) if e.micro_batch == middle else e for e in events]
    return Schedule(events=(*events, Event(n_micro_batches - 1, Phase.OPTIMIZER)), n_micro_batches=n_micro_batches,
                    sync_last=sync_last, holds_last=schedule in SINGLE_STAGE)


def _events(action: Action, stage: int) -> tuple[Event, ...]:
    """One compute action as the walk's events (none for the first stage's ``I``)."""
    kind, mb = action.kind, action.micro_batch
    if kind is ActionKind.FORWARD:
        return (Event(mb, Phase.FORWARD, stage=stage),)
    if kind is ActionKind.FULL_BACKWARD or (kind is ActionKind.BACKWARD_WEIGHT and action.stage == 0):
        return (Event(mb, Phase.BACKWARD, stage=stage),)
    if kind is ActionKind.BACKWARD_INPUT:
        return () if action.stage == 0 else (Event(mb, Phase.BACKWARD, stage=stage, part=BackwardPart.INPUT),)
    return (Event(mb, Phase.BACKWARD, stage=stage, part=BackwardPart.WEIGHT),)
