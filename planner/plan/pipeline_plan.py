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

Modelled here: the single-stage schedules (GPipe, 1F1B), whose actions are whole forwards and
backwards of one stage per rank; the looped and V schedules (several stages per rank, split
backwards) are refused in one line until their walk exists.
"""

from __future__ import annotations

from planner.errors import ConfigError
from planner.graph.stages import StageSpan, even_spans, spans_of
from planner.plan.pipeline_orders import ActionKind
from planner.plan.pipeline_schedules import SINGLE_STAGE, PipelineSchedule, check_pipeline, rank_actions
from planner.plan.schedule import Event, Phase, Schedule

_PHASES = {ActionKind.FORWARD: Phase.FORWARD, ActionKind.FULL_BACKWARD: Phase.BACKWARD}
MODELLED_SCHEDULES = tuple(s for s in PipelineSchedule if s in SINGLE_STAGE)


def check_modelled(schedule: PipelineSchedule, pp: int, n_micro_batches: int, n_blocks: int,
                   layers_per_stage: tuple[int, ...] = ()) -> None:
    """Refuse, in one line naming the field, a pipeline torch would refuse (``check_pipeline``), a
    schedule whose walk is not modelled yet, or a split that does not cover the blocks."""
    if schedule not in SINGLE_STAGE:
        modelled = ", ".join(s.value for s in MODELLED_SCHEDULES)
        raise ConfigError(f"pp_schedule: {schedule.value} runs several stages per rank or split backwards, which are "
                          f"not modelled yet; use {modelled}")
    check_pipeline(schedule, pp, n_micro_batches, 1, n_blocks)
    if layers_per_stage:
        if len(layers_per_stage) != pp or sum(layers_per_stage) != n_blocks or min(layers_per_stage) < 1:
            given = ",".join(map(str, layers_per_stage))
            raise ConfigError(f"pp_layers: {given} must give {pp} stages of at least one block each, "
                              f"{n_blocks} blocks in all; or leave it out for an even split")


def stage_spans(pp: int, n_blocks: int, layers_per_stage: tuple[int, ...] = ()) -> tuple[StageSpan, ...]:
    """Each stage's blocks: the given split, else the even one (earlier stages one block longer)."""
    return spans_of(layers_per_stage) if layers_per_stage else even_spans(n_blocks, pp)


def rank_schedule(schedule: PipelineSchedule, pp: int, n_micro_batches: int, rank: int,
                  sync_last: bool) -> Schedule:
    """Pipeline rank ``rank``'s step as events, in torch's order, then the optimizer step.
    ``sync_last``: only the step's last backward reduces gradients (DDP's ``no_sync`` on the others);
    otherwise every backward does."""
    actions = rank_actions(schedule, pp, n_micro_batches)[rank]
    last_backward = max(i for i, a in enumerate(actions) if a.kind is ActionKind.FULL_BACKWARD)
    events = tuple(Event(a.micro_batch, _PHASES[a.kind], sync=not sync_last or i == last_backward)
                   for i, a in enumerate(actions))
    return Schedule(events=(*events, Event(n_micro_batches - 1, Phase.OPTIMIZER)), n_micro_batches=n_micro_batches,
                    sync_last=sync_last)
