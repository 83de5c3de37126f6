"""torch 2.13's pipeline-parallel schedules (``torch.distributed.pipelining``): which stages each
rank holds, each rank's compute actions in the order torch runs them, and the requests torch
refuses.

A model of ``n_blocks`` blocks is cut into ``pp x v`` stages; rank ``r`` of the ``pp`` pipeline
ranks holds ``v`` of them:

- single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``, subclasses of
  ``PipelineScheduleSingle``): ``v = 1``, stage ``r`` on rank ``r``;
- looped schedules (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
  ``ScheduleInterleavedZeroBubble``): ``v >= 1``, stage ``s`` on rank ``s % pp``
  (``torch.distributed.pipelining._utils.generate_stage_to_rank_mapping(style="loop")``);
- V schedules (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``): ``v = 2``, rank ``r`` holds
  stages ``r`` and ``2 pp - 1 - r`` (``style="v"``: the stages go down the ranks and back up, so
  the turn, stages ``pp - 1`` and ``pp``, stays on the last rank).

torchtitan builds its schedules from these classes (``get_schedule_class``) with the same
mappings; this module reads torch's source only (torchtitan's was not at hand to cite).
The orders are in ``planner.plan.pipeline_orders``; ``tests/planner/test_pipeline_schedules.py``
checks them and the refusals against torch itself.
"""

from __future__ import annotations

from enum import StrEnum

from planner.errors import ConfigError
from planner.plan import pipeline_orders as orders
from planner.plan.pipeline_orders import Action, ActionKind


class PipelineSchedule(StrEnum):
    """A schedule, spelled as on the command line (torch's class in the comment)."""

    GPIPE = "gpipe"  # ScheduleGPipe
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B
    INTERLEAVED_1F1B = "interleaved-1f1b"  # ScheduleInterleaved1F1B
    LOOPED_BFS = "looped-bfs"  # ScheduleLoopedBFS
    INTERLEAVED_ZERO_BUBBLE = "interleaved-zero-bubble"  # ScheduleInterleavedZeroBubble (ZB1P)
    ZBV_ZERO_BUBBLE = "zbv-zero-bubble"  # ScheduleZBVZeroBubble
    DUALPIPEV = "dualpipev"  # ScheduleDualPipeV


SINGLE_STAGE = frozenset({PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B})
V_SHAPED = frozenset({PipelineSchedule.ZBV_ZERO_BUBBLE, PipelineSchedule.DUALPIPEV})
ROUNDS = frozenset({PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.INTERLEAVED_ZERO_BUBBLE})


def stage_rank(schedule: PipelineSchedule, pp: int, stage: int) -> int:
    """The rank holding global ``stage`` (``generate_stage_to_rank_mapping``: loop or V style)."""
    if schedule in V_SHAPED:
        lap, offset = divmod(stage, pp)
        return offset if lap % 2 == 0 else pp - 1 - offset
    return stage % pp


def rank_stages(schedule: PipelineSchedule, pp: int, virtual: int = 1) -> tuple[tuple[int, ...], ...]:
    """Each rank's stages, ascending (``generate_rank_to_stage_mapping``)."""
    held: list[list[int]] = [[] for _ in range(pp)]
    for stage in range(pp * virtual):
        held[stage_rank(schedule, pp, stage)].append(stage)
    return tuple(tuple(stages) for stages in held)


def default_virtual(schedule: PipelineSchedule) -> int:
    """Stages per rank when none is asked for: one for GPipe and 1F1B, two for the looped schedules
    (torchtitan's usual interleaving) and the V ones (which run exactly two)."""
    return 1 if schedule in SINGLE_STAGE else 2


def rank_actions(schedule: PipelineSchedule, pp: int, n_micro_batches: int,
                 virtual: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions in the order torch 2.13 runs them: for ``ScheduleGPipe`` and
    ``Schedule1F1B`` the order of their ``_step_microbatches`` loops, for the others their
    ``_calculate_single_rank_operations`` (``pipeline_order``) with the ``None`` bubbles dropped.
    The request is checked first (``check_pipeline``, without a block count)."""
    check_pipeline(schedule, pp, n_micro_batches, virtual)
    m, v = n_micro_batches, virtual
    build = {
        PipelineSchedule.GPIPE: lambda r: orders.gpipe(r, m),
        PipelineSchedule.ONE_F_ONE_B: lambda r: orders.one_f_one_b(r, pp, m),
        PipelineSchedule.LOOPED_BFS: lambda r: orders.looped_bfs(r, pp, m, v),
        PipelineSchedule.INTERLEAVED_1F1B: lambda r: orders.interleaved(r, pp, m, v, zero_bubble=False),
        PipelineSchedule.INTERLEAVED_ZERO_BUBBLE: lambda r: orders.interleaved(r, pp, m, v, zero_bubble=True),
        PipelineSchedule.ZBV_ZERO_BUBBLE: lambda r: orders.zbv(r, pp, m),
        PipelineSchedule.DUALPIPEV: lambda r: orders.dualpipev(r, pp, m),
    }[schedule]
    return tuple(tuple(build(rank)) for rank in range(pp))


def check_pipeline(schedule: PipelineSchedule, pp: int, n_micro_batches: int, virtual: int = 1,
                   n_blocks: int | None = None) -> None:
    """Raise ``ConfigError`` (one line: the field, then the fix) for a request torch 2.13 refuses
    or that has no pipeline: fewer than two ranks, the wrong number of stages per rank
    (``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``: "requires exactly 2 stages per rank"),
    micro-batch counts the constructors refuse (``Schedule1F1B``: at least ``pp``;
    ``ScheduleDualPipeV``: at least ``2 pp``, its stage count; the interleaved schedules: a multiple
    of their ``max(1, m // pp)`` rounds), and more stages than blocks to cut."""
    m, v = n_micro_batches, virtual
    name = f"--pp-schedule {schedule.value}"
    if pp < 2:
        raise ConfigError(f"--pp {pp}: {pp} rank(s) make no pipeline; use --pp 2 or more, or leave --pp-schedule out")
    if m < 1:
        raise ConfigError(f"micro-batches per step (--global-batch / (--micro-batch x data-parallel ranks)): {m}; a step needs at least one micro-batch")
    if schedule in SINGLE_STAGE and v != 1:
        raise ConfigError(f"--pp-virtual {v}: {name} runs one stage per rank; use --pp-virtual 1 or a looped schedule")
    if schedule in V_SHAPED and v != 2:
        raise ConfigError(f"--pp-virtual {v}: {name} runs exactly 2 stages per rank (a V); use --pp-virtual 2")
    if v < 1:
        raise ConfigError(f"--pp-virtual {v}: stages per rank; use at least 1")
    if schedule is PipelineSchedule.ONE_F_ONE_B and m < pp:
        raise ConfigError(f"micro-batches per step (--global-batch / (--micro-batch x data-parallel ranks)): {name} needs at least --pp = {pp} micro-batches, got {m}; "
                          f"use {pp} or more (or --pp-schedule gpipe)")
    if schedule is PipelineSchedule.DUALPIPEV and m < 2 * pp:
        raise ConfigError(f"micro-batches per step (--global-batch / (--micro-batch x data-parallel ranks)): {name} needs at least as many micro-batches as its {2 * pp} stages, "
                          f"got {m}; use {2 * pp} or more")
    rounds = max(1, m // pp)
    if schedule in ROUNDS and m % rounds:
        lo = m // pp * pp
        raise ConfigError(f"micro-batches per step (--global-batch / (--micro-batch x data-parallel ranks)): {name} runs micro-batches in {rounds} rounds, and {m} is not a multiple "
                          f"of {rounds}; use a multiple of --pp = {pp} (e.g. {lo} or {lo + pp})")
    if n_blocks is not None and pp * v > n_blocks:
        raise ConfigError(f"--pp {pp} x --pp-virtual {v} = {pp * v} stages for {n_blocks} blocks; "
                          f"use at most {n_blocks} stages in all")


__all__ = ["Action", "ActionKind", "PipelineSchedule", "check_pipeline", "default_virtual", "rank_actions", "rank_stages",
           "stage_rank"]
