"""A rank's step time as its timeline (``planner.timing.timeline``): the schedule's events on the compute
stream, the data-parallel strategy's collectives on the communication stream around them.

A strategy says which collectives it issues around one micro-batch (``Collectives``); this module
places them, event by event of the step's schedule (``planner.plan.schedule``), with the waits PyTorch
has:

- FSDP2: the root's all-gather before the forward (nothing runs before it); the blocks'
  all-gathers issued with the forward (each prefetched during the previous unit's compute); under
  ZeRO-3 the root gathered again at the loss gradient, before the backward; the blocks' all-gathers
  and, in a backward that syncs, their reduce-scatters beside the backward; the root's
  reduce-scatter after it (autograd's final callback), before the next micro-batch starts;
- DDP: the gradient buckets all-reduced beside the last micro-batch's backward (``no_sync`` on the
  others), the last bucket after it, before the optimizer step; ZeRO-1 broadcasts the updated
  partitions after the step.

Tensor-, context- and expert-parallel collectives sit inside the ops that issue them (their time is
part of the op's, ``planner.timing.op_times``): they are on the compute stream's critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.memory.types import Phase
from planner.plan.schedule import Event, Schedule
from planner.timing.timeline import RankTimeline, Segment, Stream, Task, run_segment


@dataclass(frozen=True)
class Collectives:
    """A data-parallel strategy's collectives around one micro-batch (seconds each, ring model)."""

    before_forward_s: float = 0.0  # waited for before the forward starts (FSDP2: the root's all-gather)
    during_forward_s: float = 0.0  # issued with the forward, beside it (FSDP2: the blocks' all-gathers)
    before_backward_s: float = 0.0  # waited for before the backward (ZeRO-3: the root gathered again)
    during_backward_s: float = 0.0  # beside every backward (ZeRO-3: the blocks' all-gathers)
    during_sync_backward_s: float = 0.0  # beside a backward that syncs (reduce-scatters; DDP: all buckets but the last)
    after_sync_backward_s: float = 0.0  # after it (FSDP2: the root's reduce-scatter; DDP: the last bucket)
    after_optimizer_s: float = 0.0  # after the optimizer step (ZeRO-1: the updated partitions' broadcast)

    @property
    def none(self) -> bool:
        return not any((self.before_forward_s, self.during_forward_s, self.before_backward_s, self.during_backward_s,
                        self.during_sync_backward_s, self.after_sync_backward_s, self.after_optimizer_s))


NO_COLLECTIVES = Collectives()


@dataclass(frozen=True)
class Communication:
    """A rank's data-parallel collectives over one step, read off its timeline."""

    total_s: float  # the collectives' own time
    exposed_s: float  # what they add to the step: not hidden by compute, and compute slowed beside them
    bytes_moved: float  # bytes the rank sends over its link


def communication(timeline: RankTimeline, compute_s: float, bytes_moved: float) -> Communication:
    """The summary of ``timeline``, whose compute stream does ``compute_s`` of work."""
    return Communication(total_s=timeline.busy_s(Stream.COMMUNICATION),
                         exposed_s=timeline.step_time_s - compute_s, bytes_moved=bytes_moved)


def _phase(tasks: list[Task], tag: str, waits: tuple[str, ...], compute_s: float, before_s: float, during_s: float,
           after_s: float) -> tuple[str, ...]:
    """Append one phase's tasks (collective before, compute beside a collective, collective after);
    return what the next phase waits for."""
    if before_s:
        tasks.append(Task(f"{tag}: collectives before", Stream.COMMUNICATION, before_s, waits))
        waits = (tasks[-1].name,)
    tasks.append(Task(tag, Stream.COMPUTE, compute_s, waits))
    ends = [tag]
    if during_s:
        tasks.append(Task(f"{tag}: collectives beside", Stream.COMMUNICATION, during_s, waits))
        ends.append(tasks[-1].name)
    if after_s:
        tasks.append(Task(f"{tag}: collectives after", Stream.COMMUNICATION, after_s, tuple(ends)))
        return (tasks[-1].name,)
    return tuple(ends)


def _event_tasks(tasks: list[Task], event: Event, waits: tuple[str, ...], forward_s: float, backward_s: float,
                 optimizer_s: float, c: Collectives) -> tuple[str, ...]:
    tag = f"{event.phase.value} {event.micro_batch}"
    if event.phase is Phase.FORWARD:
        return _phase(tasks, tag, waits, forward_s, c.before_forward_s, c.during_forward_s, 0.0)
    if event.phase is Phase.BACKWARD:
        beside = c.during_backward_s + (c.during_sync_backward_s if event.sync else 0.0)
        return _phase(tasks, tag, waits, backward_s, c.before_backward_s, beside,
                      c.after_sync_backward_s if event.sync else 0.0)
    return _phase(tasks, tag, waits, optimizer_s, 0.0, 0.0, c.after_optimizer_s)


def rank_timeline(schedule: Schedule, forward_s: float, backward_s: float, optimizer_s: float,
                  collectives: Collectives, slowdown: float) -> RankTimeline:
    """One rank's step: every event of ``schedule`` (``forward_s``/``backward_s``: one
    micro-batch's compute, recomputation in the backward), the collectives around each. Events of
    one micro-batch that stand for ``repeats`` identical ones form one segment counted that often."""
    segments: list[Segment] = []
    group: list[Event] = []

    def close() -> None:
        if group:
            tasks: list[Task] = []
            waits: tuple[str, ...] = ()
            for event in group:
                waits = _event_tasks(tasks, event, waits, forward_s, backward_s, optimizer_s, collectives)
            name = f"micro-batch {group[0].micro_batch + 1}" if group[0].phase is not Phase.OPTIMIZER else "optimizer"
            segments.append(run_segment(name, tuple(tasks), slowdown, group[0].repeats))
            group.clear()

    for event in schedule.events:
        if group and (event.micro_batch, event.repeats) != (group[0].micro_batch, group[0].repeats) or (
                event.phase is Phase.OPTIMIZER):
            close()
        group.append(event)
    close()
    return RankTimeline(segments=tuple(segments))
