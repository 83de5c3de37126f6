"""The time of one pipeline-parallel step: each rank runs its actions in torch's order
(``planner.plan.pipeline_schedules.rank_actions``), each waiting for what a pipeline makes it wait
for, on the timeline of ``planner.timing.timeline``; the bubble is whatever idle time that order
leaves, never a closed form.

The dependencies (those torch's runtime enforces with its receives, ``_PipelineScheduleRuntime``):

- forward ``F(s, i)`` waits for ``F(s - 1, i)``'s activation to arrive;
- backward ``B(s, i)`` or ``I(s, i)`` waits for ``F(s, i)`` and for the gradient of ``B/I(s + 1, i)``
  (the last stage: for its own forward only, the loss is computed in it);
- weight gradient ``W(s, i)`` waits for ``I(s, i)``;
- a rank runs its compute actions one at a time, in order (an ``OVERLAP_F_B``'s parts one after
  the other, as torch runs them unless a custom function is registered).

An activation or gradient crossing ranks is a send of ``p2p_s`` seconds on the sender's
communication stream (one NCCL stream: a rank's sends go one at a time, in the order of its
actions); between two stages of one rank (the turn of a V) nothing is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.plan.pipeline_plan import walked_micro_batches
from planner.plan.pipeline_schedules import Action, ActionKind, PipelineSchedule, rank_actions, stage_rank
from planner.timing.timeline import RankTimeline, Stream, Task, run_segment


@dataclass(frozen=True)
class StageTime:
    """One micro-batch's compute on one stage: forward, backward for inputs (dI) and backward for
    weights (dW); a full backward takes both."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s

    def of(self, kind: ActionKind) -> float:
        return {ActionKind.FORWARD: self.forward_s, ActionKind.FULL_BACKWARD: self.backward_s,
                ActionKind.BACKWARD_INPUT: self.backward_input_s,
                ActionKind.BACKWARD_WEIGHT: self.backward_weight_s}[kind]


@dataclass(frozen=True)
class PipelineTime:
    """A pipeline step: its span, each rank's compute (``busy_s``) and waiting (``idle_s``)."""

    step_time_s: float
    busy_s: tuple[float, ...]  # per rank, seconds of compute
    idle_s: tuple[float, ...]  # per rank, step_time_s - busy_s: the bubble (and exposed sends)
    timeline: RankTimeline | None  # every rank's tasks (critical path, spans); None when extrapolated

    @property
    def bubble_fraction(self) -> float:
        """The share of the ranks' step spent idle: sum(idle) / (pp x step). For GPipe and 1F1B on
        uniform stages it is (p - 1) / (m + p - 1) (Narayanan et al. 2021, arXiv 2104.04473, sec. 2.2)."""
        return math.fsum(self.idle_s) / (len(self.idle_s) * self.step_time_s)

    @property
    def bubble_overhead(self) -> float:
        """Idle over compute: sum(idle) / sum(busy), Narayanan et al.'s "bubble time fraction"
        t_pb / t_id, (p - 1) / m for GPipe and 1F1B on uniform stages."""
        return math.fsum(self.idle_s) / math.fsum(self.busy_s)


def _send_name(action: Action) -> str:
    return f"send {action}"


def pipeline_tasks(schedule: PipelineSchedule, pp: int, n_micro_batches: int, stage_times: tuple[StageTime, ...],
                   p2p_s: float, virtual: int = 1) -> tuple[Task, ...]:
    """Every rank's compute tasks in torch's order, each followed by the send of its output when
    the next stage (a forward) or the previous one (a backward) is on another rank."""
    ranks = rank_actions(schedule, pp, n_micro_batches, virtual)
    n_stages = pp * virtual
    if len(stage_times) != n_stages:
        raise ValueError(f"{len(stage_times)} stage times for {n_stages} stages")
    runs = [c for actions in ranks for a in actions for c in a.computations()]
    grad_of = {(a.stage, a.micro_batch): a for a in runs if a.kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT)}

    def arrival(src: Action, dst_stage: int) -> str:
        crosses = stage_rank(schedule, pp, src.stage) != stage_rank(schedule, pp, dst_stage)
        return _send_name(src) if crosses else str(src)

    def waits(a: Action) -> tuple[str, ...]:
        if a.kind is ActionKind.FORWARD:
            return (arrival(Action(a.stage - 1, a.kind, a.micro_batch), a.stage),) if a.stage > 0 else ()
        if a.kind is ActionKind.BACKWARD_WEIGHT:
            return (str(Action(a.stage, ActionKind.BACKWARD_INPUT, a.micro_batch)),)
        after = (str(Action(a.stage, ActionKind.FORWARD, a.micro_batch)),)
        return after + ((arrival(grad_of[a.stage + 1, a.micro_batch], a.stage),) if a.stage < n_stages - 1 else ())

    def sends(a: Action) -> bool:
        peer = a.stage + 1 if a.kind is ActionKind.FORWARD else a.stage - 1
        return (a.kind is not ActionKind.BACKWARD_WEIGHT and 0 <= peer < n_stages
                and stage_rank(schedule, pp, peer) != stage_rank(schedule, pp, a.stage))

    tasks: list[Task] = []
    for rank, actions in enumerate(ranks):
        for a in (c for action in actions for c in action.computations()):
            tasks.append(Task(str(a), Stream.COMPUTE, stage_times[a.stage].of(a.kind), waits(a), rank))
            if sends(a):
                tasks.append(Task(_send_name(a), Stream.COMMUNICATION, p2p_s, (str(a),), rank))
    return tuple(tasks)


def pipeline_time(schedule: PipelineSchedule, pp: int, n_micro_batches: int,
                  stage_times: StageTime | tuple[StageTime, ...], p2p_s: float = 0.0, virtual: int = 1,
                  slowdown: float = 0.0, whole: bool = True) -> PipelineTime:
    """The step of ``schedule`` on ``pp`` ranks (``virtual`` stages each) over ``n_micro_batches``:
    ``stage_times`` per global stage (one ``StageTime``: every stage alike), ``p2p_s`` for one
    activation or gradient send between ranks, ``slowdown`` the compute slowdown while a send runs
    beside it (``planner.timing.timeline.run_segment``).

    Without ``whole``, a bounded schedule's long step (``planner.plan.pipeline_plan.BOUNDED``) is
    timed from two short ones: its steady state adds the same span per micro-batch, so the span
    is extrapolated linearly from ``walked_micro_batches`` and ``pp`` more, each rank's compute
    scaled (it is the micro-batches' sum); no timeline is kept (tests/planner/test_pipeline_time.py
    checks the figures equal the whole step's)."""
    short = walked_micro_batches(schedule, pp, n_micro_batches, virtual)
    if not whole and short + pp < n_micro_batches:
        a = pipeline_time(schedule, pp, short, stage_times, p2p_s, virtual, slowdown)
        b = pipeline_time(schedule, pp, short + pp, stage_times, p2p_s, virtual, slowdown)
        step_s = a.step_time_s + (n_micro_batches - short) * (b.step_time_s - a.step_time_s) / pp
        busy = tuple(x * n_micro_batches / short for x in a.busy_s)
        return PipelineTime(step_time_s=step_s, busy_s=busy, idle_s=tuple(step_s - x for x in busy), timeline=None)
    n_stages = pp * virtual
    times = stage_times if isinstance(stage_times, tuple) else (stage_times,) * n_stages
    tasks = pipeline_tasks(schedule, pp, n_micro_batches, times, p2p_s, virtual)
    segment = run_segment(f"pipeline {schedule.value}", tasks, slowdown)
    line = RankTimeline(segments=(segment,))
    busy = tuple(line.busy_s(Stream.COMPUTE, rank) for rank in range(pp))
    return PipelineTime(step_time_s=line.step_time_s, busy_s=busy, idle_s=tuple(line.idle_s(r) for r in range(pp)),
                        timeline=line)
