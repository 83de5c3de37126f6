"""A rank's step as a timeline: tasks on streams, what each waits for, and what overlaps.

A rank runs its kernels on one compute stream and its data-parallel collectives on a
communication stream (NCCL's own stream, as PyTorch issues FSDP2's all-gathers and
reduce-scatters and DDP's bucket all-reduces). A task starts when its stream is free and every
task it waits for (``Task.after``) has ended, and ends once its work is done. While a collective
runs beside compute, the compute runs ``1 + slowdown`` times slower (the kernels share the SMs and
memory bandwidth with NCCL's: the hardware profile's ``overlap_compute_slowdown``, a published
measurement); a collective runs at its own speed. Two tasks of equal work side by side therefore
take ``max(collective, compute x (1 + slowdown))`` when the collective outlasts the slowed compute
and ``compute + collective x slowdown / (1 + slowdown)`` otherwise: ``planner.parallel.collectives.overlapped_s``
is this rule's closed form for one pair.

The step time is when the last task ends. The critical path is the chain of tasks, each started
the moment the one before it ended, that ends the step: the collectives on it are exposed, the
ones off it are hidden. A stretch of the step that starts and ends with every stream idle is a
``Segment``; identical stretches (the middle micro-batches of gradient accumulation) are run once
and counted ``repeats`` times, as the memory walk visits one micro-batch for each kind
(``planner.plan.schedule``). A pipeline's stages are several ranks whose tasks wait for each other's
sends: their idle time (the bubble) is what falls between their spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class Stream(StrEnum):
    """Where a task runs on its rank."""

    COMPUTE = "compute"  # the kernels of forward, backward, recompute and the optimizer step
    COMMUNICATION = "communication"  # data-parallel collectives (all-gather, reduce-scatter, all-reduce)


@dataclass(frozen=True)
class Task:
    """One piece of work: ``work_s`` seconds on ``rank``'s ``stream`` once every task in ``after``
    has ended (on any rank: a pipeline stage waits for the previous stage's send)."""

    name: str
    stream: Stream
    work_s: float
    after: tuple[str, ...] = ()
    rank: int = 0


@dataclass(frozen=True)
class Span:
    """When a task ran, and what it waited for last (its predecessor on the critical path)."""

    task: Task
    start_s: float
    end_s: float
    waited_for: str | None  # the task whose end let it start (None: it started the segment)


@dataclass(frozen=True)
class Segment:
    """A stretch of the step from idle streams to idle streams, run ``repeats`` times."""

    name: str
    spans: tuple[Span, ...]
    repeats: int = 1

    @property
    def span_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    def critical_path(self) -> tuple[Span, ...]:
        """The chain of spans that ends the segment, first to last."""
        if not self.spans:
            return ()
        by_name = {s.task.name: s for s in self.spans}
        span: Span | None = max(self.spans, key=lambda s: s.end_s)
        chain = []
        while span is not None:
            chain.append(span)
            span = by_name.get(span.waited_for) if span.waited_for else None
        return tuple(reversed(chain))


@dataclass(frozen=True)
class RankTimeline:
    """One rank's step: its segments in order."""

    segments: tuple[Segment, ...]

    @property
    def step_time_s(self) -> float:
        return math.fsum(seg.repeats * seg.span_s for seg in self.segments)

    def busy_s(self, stream: Stream, rank: int | None = None) -> float:
        """Seconds of work ``stream`` does in the step (slowdown excluded), of one rank or all."""
        return math.fsum(seg.repeats * s.task.work_s for seg in self.segments for s in seg.spans
                         if s.task.stream is stream and rank in (None, s.task.rank))

    def idle_s(self, rank: int) -> float:
        """Seconds ``rank``'s compute stream waits in the step: a pipeline's bubble, a collective's
        exposure."""
        return self.step_time_s - self.busy_s(Stream.COMPUTE, rank)

    def exposed_s(self, stream: Stream) -> float:
        """Seconds of ``stream``'s tasks on the critical path: the step would be that much shorter
        if they took no time (for the communication stream: the collectives compute does not hide)."""
        return math.fsum(seg.repeats * (s.end_s - s.start_s) for seg in self.segments for s in seg.critical_path()
                         if s.task.stream is stream)


def run_segment(name: str, tasks: tuple[Task, ...], slowdown: float, repeats: int = 1) -> Segment:
    """Run ``tasks`` from idle streams (each rank's stream takes its tasks in the order given),
    a rank's compute slowed by ``1 + slowdown`` while a collective of that rank runs beside it."""
    queues: dict[tuple[int, Stream], list[Task]] = {}
    for task in tasks:
        queues.setdefault((task.rank, task.stream), []).append(task)
    ended: dict[str, float] = {}
    spans: list[Span] = []
    running: dict[tuple[int, Stream], tuple[Task, float, float, str | None]] = {}  # task, work left, start, waited for
    last_on: dict[tuple[int, Stream], str] = {}
    now = 0.0
    while True:
        for stream, queue in queues.items():
            if stream not in running and queue and all(a in ended for a in queue[0].after):
                task = queue.pop(0)
                waits = [(ended[a], a) for a in task.after]
                if stream in last_on:
                    waits.append((ended[last_on[stream]], last_on[stream]))
                running[stream] = (task, task.work_s, now, max(waits)[1] if waits else None)
        if not running:
            break
        busy = {rank for rank, kind in running if kind is not Stream.COMPUTE}  # ranks with a collective running
        rates = {s: (1.0 / (1.0 + slowdown) if s[1] is Stream.COMPUTE and s[0] in busy else 1.0) for s in running}
        step = min(left / rates[s] for s, (_, left, _, _) in running.items())
        now += step
        for stream in list(running):
            task, left, start, waited = running[stream]
            left -= step * rates[stream]
            if left <= 1e-15 * max(1.0, task.work_s):
                del running[stream]
                ended[task.name] = now
                last_on[stream] = task.name
                spans.append(Span(task, start, now, waited))
            else:
                running[stream] = (task, left, start, waited)
    stuck = [t.name for queue in queues.values() for t in queue]
    if stuck:
        raise ValueError(f"timeline {name}: tasks {stuck} wait for tasks that never run")
    return Segment(name=name, spans=tuple(spans), repeats=repeats)


def overlapped_s(compute_s: float, comm_s: float, slowdown: float) -> float:
    """The closed form of ``run_segment`` for one compute task beside one collective, both
    started together: what the collective adds to the compute's ``compute_s``. A collective
    shorter than the slowed compute costs ``comm_s x slowdown / (1 + slowdown)``; a longer one
    hides the compute and adds what it outlasts it by."""
    if comm_s <= 0:
        return 0.0
    if comm_s >= compute_s * (1.0 + slowdown):
        return comm_s - compute_s
    return comm_s * slowdown / (1.0 + slowdown)
