"""The predicted step as spans: every task of a plan's timeline, and every op inside it, with its
start and end in seconds, per rank and stream; and the allocated bytes over the same clock.

This is what the exports draw (``roofplan.export_trace``, ``roofplan.export_html``). It rebuilds
the plan's step program (``planner.program.estimate.step_program``) and places it as the estimate
does: the rank's timeline (``planner.timing.step_time``; a pipeline's, ``planner.timing.pipeline_time``)
gives each task's span, and a compute task is cut into its ops in their order, each as long as its
predicted time (``OpTimes``), stretched where a collective of the rank runs beside it (compute
runs ``1 + overlap_compute_slowdown`` slower then: the timeline's own rule, so the last op ends
where its task ends). A backward runs its ops in reverse and a checkpoint unit's recompute just
before the backward of the op that unpacks its first saved tensor (as the memory walk does).
Tensor-, context- and expert-parallel collectives are part of their op's time (the share the op
waits for): drawn at the end of the op on their own stream.

Identical stretches (the middle micro-batches of accumulation, ``Segment.repeats``) are drawn
once each up to ``max_ops`` op spans in all; the rest of a stretch is one span per stream named
for how many it stands for, so the last span still ends at the step time.

A pipeline's tasks alone (its actions and sends, no ops, no memory: ``pipeline_tasks``, what
``plan --plot`` draws as ``pipeline.png``) are read off the estimate's timeline, cheap at any size.

Memory: the walk's trace (``StepProgram.walk(record_trace=True)``: live bytes after each op's
allocations) placed at the start of the op it belongs to (several samples of one op spread over
it), on the same clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner.memory.prepared import recompute_span
from planner.memory.types import Phase, TraceEvent
from planner.plan.checkpointing import op_units
from planner.program.estimate import op_rooflines, step_program
from planner.program.pipeline_program import pipelined_time
from planner.program.results import PlanResult
from planner.program.step_program import RankProgram, StepProgram
from planner.timing.op_times import OpRoofline, TimeBreakdown
from planner.timing.timeline import Segment, Span, Stream

COMPUTE = "compute"
DATA_PARALLEL = "data-parallel collectives"
PIPELINE = "pipeline sends"
INSIDE_OPS = {"tp": "tensor-parallel collectives (inside ops)", "cp": "context-parallel collectives (inside ops)",
              "ep": "expert-parallel collectives (inside ops)"}


@dataclass(frozen=True)
class OpSpan:
    """One drawn span: a task (depth 0) or an op inside it (depth 1) on ``rank``'s ``stream``."""

    rank: int
    stream: str
    name: str
    phase: str  # forward, backward, recompute, optimizer, collective, repeat
    start_s: float
    end_s: float
    depth: int = 0
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MemorySample:
    rank: int
    time_s: float
    allocated_bytes: int
    label: str  # "forward blocks.3.mlp.up_proj (micro-batch 0)"


@dataclass(frozen=True)
class StepSpans:
    """The drawn step: spans, memory samples, the ranks' labels and the step time they end at."""

    spans: tuple[OpSpan, ...]
    memory: tuple[MemorySample, ...]
    ranks: tuple[str, ...]  # one label per drawn rank (pipeline stages; else one rank for all)
    step_time_s: float
    peak_allocated_bytes: tuple[int, ...]  # per drawn rank


@dataclass
class _Rank:
    """What cutting one rank's tasks into ops needs."""

    index: int
    program: RankProgram
    recomputed: frozenset[str]
    rooflines: dict[str, OpRoofline]
    trace: tuple[TraceEvent, ...]
    slowdown: float
    zero_stage: int
    triggers: dict[int, list[int]] = field(default_factory=dict)  # op position -> recomputed positions before its backward


def step_spans(result: PlanResult, max_ops: int = 200_000) -> StepSpans:
    """The chosen plan's step (``result.best``) as spans and memory samples (module docstring)."""
    model, training, hw, knobs = result.model.config, result.training, result.hardware, result.best.knobs
    program = step_program(model, training, hw, knobs)
    walks = tuple(program.walk(rank=r, record_trace=True) for r in program.ranks)
    pairs = enumerate(zip(program.ranks, walks, strict=True))
    ranks = [_rank(i, program, r, w.recomputed_ops, w.trace, knobs.parallel.zero_stage) for i, (r, w) in pairs]
    spans: list[OpSpan] = []
    memory: list[MemorySample] = []
    if knobs.parallel.pp > 1:
        time = pipelined_time(program, knobs, tuple(r.recomputed for r in ranks))
        labels = _pipeline(program, ranks, time, knobs, spans, memory)
    else:
        time = program.time(ranks[0].recomputed)
        _accumulation(ranks[0], time, spans, memory, max_ops)
        labels = (f"rank 0 (every one of the {program.world_size} GPUs alike)",)
    return StepSpans(spans=tuple(spans), memory=tuple(memory), ranks=labels, step_time_s=time.step_time_s,
                     peak_allocated_bytes=tuple(w.peak.bytes for w in walks))


def _rank(index: int, program: StepProgram, rank: RankProgram, recomputed: frozenset[str],
          trace: tuple[TraceEvent, ...], zero_stage: int) -> _Rank:
    graph = rank.graph
    out = _Rank(index, rank, recomputed, {o.name: o for o in op_rooflines(graph, program.hw)}, trace,
                program.hw.overlap_compute_slowdown, zero_stage)
    nodes = graph.nodes
    unit, cached = op_units([n.spec.kind for n in nodes], [n.spec.block for n in nodes],
                            [n.spec.bias for n in nodes], program.units)
    members: dict[int, list[int]] = {}
    for position, u in enumerate(unit):
        if u is not None:
            members.setdefault(u, []).append(position)
    for positions in members.values():  # the walk's trigger: the backward that unpacks the first save
        ran, final = recompute_span([nodes[i].cost for i in positions])
        trigger = positions[final if final is not None else max(0, ran - 1)]
        out.triggers[trigger] = [i for i in positions if graph.order[i] in recomputed]
    return out


def _accumulation(rank: _Rank, time: TimeBreakdown, spans: list[OpSpan], memory: list[MemorySample],
                  max_ops: int) -> None:
    """Every segment of one rank's accumulation step, in order, each repeated as it counts."""
    assert time.timeline is not None
    per_copy = max(1, 3 * len(rank.program.graph.nodes))
    budget = max_ops
    offset = 0.0
    for segment in time.timeline.segments:
        drawn = max(1, min(segment.repeats, budget // per_copy))
        budget -= drawn * per_copy
        for _ in range(drawn):
            _segment(rank, segment, offset, spans, memory)
            offset += segment.span_s
        if segment.repeats > drawn:
            rest = segment.repeats - drawn
            streams = {COMPUTE} | ({DATA_PARALLEL} if any(s.task.stream is Stream.COMMUNICATION
                                                          for s in segment.spans) else set())
            for stream in sorted(streams):
                spans.append(OpSpan(rank.index, stream, f"{segment.name} x {rest} more (identical, not drawn)",
                                    "repeat", offset, offset + rest * segment.span_s,
                                    args={"repeats": rest, "each_s": segment.span_s}))
            offset += rest * segment.span_s


def _segment(rank: _Rank, segment: Segment, offset: float, spans: list[OpSpan],
             memory: list[MemorySample]) -> None:
    """One run of ``segment`` from ``offset``: its tasks, the ops of its compute tasks, memory."""
    beside = [(offset + s.start_s, offset + s.end_s) for s in segment.spans if s.task.stream is Stream.COMMUNICATION]
    ops: dict[tuple[int, str, str], tuple[float, float]] = {}
    for span in segment.spans:
        start, end = offset + span.start_s, offset + span.end_s
        if span.task.stream is Stream.COMMUNICATION:
            spans.append(OpSpan(rank.index, DATA_PARALLEL, _collective_label(span, rank.zero_stage), "collective",
                                start, end, args={"task": span.task.name, "work_s": span.task.work_s}))
            continue
        phase, _, mb = span.task.name.partition(" ")
        spans.append(OpSpan(rank.index, COMPUTE, span.task.name, phase, start, end, args={"work_s": span.task.work_s}))
        if phase == Phase.OPTIMIZER.value:
            ops[(-1, Phase.OPTIMIZER.value, "optimizer.step")] = (start, end)
        elif mb.isdigit():
            _cut(rank, Phase(phase), int(mb), start, end, beside, spans, ops)
    _samples(rank, segment, ops, memory)


def _pipeline(program: StepProgram, ranks: list[_Rank], time: TimeBreakdown, knobs: Any, spans: list[OpSpan],
              memory: list[MemorySample]) -> tuple[str, ...]:
    """Every rank's actions on the pipeline's timeline, then the data-parallel sync and each rank's
    optimizer step: the step is the span, the most any rank's collectives add after its last
    backward, and the slowest optimizer step (``planner.program.pipeline_program.pipelined_time``).
    Returns the ranks' labels."""
    from planner.plan.pipeline_schedules import rank_stages

    assert time.timeline is not None
    held = rank_stages(knobs.pp_schedule, knobs.parallel.pp, getattr(knobs, "pp_virtual", 1))
    parts = {stage: _rank(r.index, program, part, r.recomputed, r.trace, r.zero_stage)
             for r in ranks for part, stage in zip((r.program, *r.program.others), held[r.index], strict=True)}
    actions = _actions(knobs)
    segment = time.timeline.segments[0]
    line_s = segment.span_s
    optimizer_s = [r.program.optimizer_s[0] for r in ranks]
    exposed_s = time.step_time_s - line_s - max(optimizer_s)
    for rank in ranks:
        mine = [s for s in segment.spans if s.task.rank == rank.index]
        beside = [(s.start_s, s.end_s) for s in mine if s.task.stream is Stream.COMMUNICATION]
        ops: dict[tuple[int, str, str], tuple[float, float]] = {}
        for span in mine:
            task = _pipeline_task(span, actions)
            spans.append(task)
            if task.stream == COMPUTE and task.args["kind"] != "W":
                _cut(parts[task.args["stage"]], Phase(task.phase), task.args["micro_batch"], task.start_s, task.end_s,
                     beside, spans, ops)
        if exposed_s > 1e-15:
            spans.append(OpSpan(rank.index, DATA_PARALLEL, "data-parallel gradient sync (the most any rank's adds)",
                                "collective", line_s, line_s + exposed_s))
        start = line_s + max(0.0, exposed_s)
        spans.append(OpSpan(rank.index, COMPUTE, "optimizer step", Phase.OPTIMIZER.value, start,
                            start + optimizer_s[rank.index]))
        ops[(-1, Phase.OPTIMIZER.value, "optimizer.step")] = (start, start + optimizer_s[rank.index])
        _samples(rank, None, ops, memory)
    return tuple(f"rank {r.index} (stages {', '.join(map(str, held[r.index]))}: blocks "
                 f"{', '.join(f'{s.first_block}-{s.last_block}' for s in r.program.spans)}; "
                 f"{r.program.ranks} GPUs alike)" for r in ranks)


def pipeline_tasks(result: PlanResult) -> tuple[tuple[OpSpan, ...], float]:
    """A pipeline plan's tasks alone, as ``step_spans`` draws them (depth 0: every rank's compute
    actions and sends), and the pipeline's span: read off the estimate's own timeline, without ops
    or memory, so cheap at any size (``step_spans`` cuts every action into its ops). A plan read
    back from a file has no timeline: it is placed again, as ``step_spans`` places it."""
    knobs = result.best.knobs
    timeline = result.best.estimate.time.timeline
    if timeline is None:
        program = step_program(result.model.config, result.training, result.hardware, knobs)
        recomputed = tuple(program.walk(rank=r).recomputed_ops for r in program.ranks)
        timeline = pipelined_time(program, knobs, recomputed).timeline
    assert timeline is not None
    (segment,) = timeline.segments
    actions = _actions(knobs)
    spans = sorted(segment.spans, key=lambda s: (s.task.rank, s.start_s, s.task.stream is Stream.COMMUNICATION))
    return tuple(_pipeline_task(s, actions) for s in spans), segment.span_s


def _actions(knobs: Any) -> dict[str, Any]:
    """The schedule's compute actions by their task names (torch's spelling, ``1F0``, ``0I3``)."""
    from planner.plan.pipeline_schedules import rank_actions

    return {str(a): a for acts in rank_actions(knobs.pp_schedule, knobs.parallel.pp, knobs.grad_accum_steps,
                                               getattr(knobs, "pp_virtual", 1))
            for action in acts for a in action.computations()}


def _pipeline_task(span: Span, actions: dict[str, Any]) -> OpSpan:
    """One span of the pipeline's timeline: a send on its rank's ``PIPELINE`` stream, or a compute
    action (its stage, micro-batch and kind, F / B / I / W, in ``args``)."""
    rank = span.task.rank
    if span.task.stream is Stream.COMMUNICATION:
        return OpSpan(rank, PIPELINE, span.task.name, "collective", span.start_s, span.end_s)
    action = actions[span.task.name]
    phase = Phase.FORWARD if action.kind.value == "F" else Phase.BACKWARD
    return OpSpan(rank, COMPUTE, f"{phase.value} {action.micro_batch} ({span.task.name})", phase.value,
                  span.start_s, span.end_s,
                  args={"stage": action.stage, "micro_batch": action.micro_batch, "kind": action.kind.value})


_FSDP2 = {("forward", "collectives before"): "all-gather: root",
          ("forward", "collectives beside"): "all-gather: blocks (prefetched)",
          ("backward", "collectives before"): "all-gather: root again (ZeRO-3)",
          ("backward", "collectives beside"): "blocks: reduce-scatter (and ZeRO-3 all-gather)",
          ("backward", "collectives after"): "reduce-scatter: root"}
_DDP = {("backward", "collectives beside"): "all-reduce: gradient buckets",
        ("backward", "collectives after"): "all-reduce: last bucket",
        ("optimizer", "collectives after"): "broadcast: updated partitions (ZeRO-1)"}


def _collective_label(span: Span, zero_stage: int) -> str:
    """``backward 0: collectives beside`` -> what runs there (by the ZeRO stage's strategy)."""
    tag, _, where = span.task.name.partition(": ")
    names = _FSDP2 if zero_stage >= 2 else _DDP
    return f"{names.get((tag.split(' ')[0], where), where)} [{tag}]"


def _cut(rank: _Rank, phase: Phase, micro_batch: int, start: float, end: float,
         beside: list[tuple[float, float]], spans: list[OpSpan],
         ops: dict[tuple[int, str, str], tuple[float, float]]) -> None:
    """Cut a compute task into its ops (forward order, or backward with recompute before triggers)."""
    times, names = rank.program.times, rank.program.graph.order
    order: list[tuple[int, Phase]] = []
    if phase is Phase.FORWARD:
        order = [(i, Phase.FORWARD) for i in range(len(names))]
    else:
        for i in range(len(names) - 1, -1, -1):
            order += [(j, Phase.RECOMPUTE) for j in rank.triggers.get(i, ())]
            order.append((i, Phase.BACKWARD))
    wall = _Clock(start, end, beside, rank.slowdown)
    work = 0.0
    for i, kind in order:
        op_s = times.bwd_s[i] if kind is Phase.BACKWARD else times.fwd_s[i]
        t0, work = wall.at(work), work + op_s
        t1 = wall.at(work)
        ops[(micro_batch, kind.value, names[i])] = (t0, t1)
        if op_s <= 0:
            continue
        spans.append(OpSpan(rank.index, COMPUTE, names[i], kind.value, t0, t1, 1,
                            _op_args(rank, i, kind, micro_batch)))
        _inside_ops(rank, i, kind, t1, (t1 - t0) / op_s, spans)


def _op_args(rank: _Rank, i: int, kind: Phase, micro_batch: int) -> dict[str, Any]:
    op = rank.rooflines[rank.program.graph.order[i]]
    backward = kind is Phase.BACKWARD
    flops, n_bytes = (op.bwd_flops, op.bwd_bytes) if backward else (op.fwd_flops, op.fwd_bytes)
    return {"op": op.name, "kind": op.kind, "phase": kind.value, "micro_batch": micro_batch, "flops": flops,
            "bytes": n_bytes, "intensity_flops_per_byte": round(flops / n_bytes, 3) if n_bytes else None,
            "bound": op.bound.value, "block": op.block}


def _inside_ops(rank: _Rank, i: int, kind: Phase, end: float, stretch: float, spans: list[OpSpan]) -> None:
    """The collectives an op waits for (TP, CP, EP), at its end on their own streams."""
    t = rank.program.times
    b = kind is Phase.BACKWARD
    comm, cp, ep = ((seq[i] if seq else 0.0) for seq in ((t.bwd_comm_s, t.bwd_cp_s, t.bwd_ep_s) if b else
                                                          (t.fwd_comm_s, t.fwd_cp_s, t.fwd_ep_s)))
    if comm <= 0:
        return
    for dim, seconds in (("tp", comm - cp - ep), ("cp", cp), ("ep", ep)):
        if seconds > 1e-15:
            spans.append(OpSpan(rank.index, INSIDE_OPS[dim], f"{rank.program.graph.order[i]} ({kind.value})",
                                "collective", end - seconds * stretch, end, args={"exposed_s": seconds}))


class _Clock:
    """Wall time of a compute task's work: ``1 + slowdown`` slower while a collective of the rank runs."""

    def __init__(self, start: float, end: float, beside: list[tuple[float, float]], slowdown: float) -> None:
        cuts = sorted({start, end, *(t for pair in beside for t in pair if start < t < end)})
        self.pieces = []  # (wall start, work at start, rate)
        work = 0.0
        for a, b in zip(cuts, cuts[1:], strict=False):
            busy = any(s < b and e > a for s, e in beside)
            rate = 1.0 / (1.0 + slowdown) if busy else 1.0
            self.pieces.append((a, work, rate))
            work += (b - a) * rate
        self.start, self.end = start, end

    def at(self, work: float) -> float:
        for a, w0, rate in reversed(self.pieces):
            if work >= w0:
                return min(self.end, a + (work - w0) / rate)
        return self.start


def _samples(rank: _Rank, segment: Segment | None, ops: dict[tuple[int, str, str], tuple[float, float]],
             memory: list[MemorySample]) -> None:
    """The walk's samples of the micro-batches drawn here (``segment``'s; a pipeline rank: all)."""
    walked = {mb for mb, _, _ in ops}
    events = [e for e in rank.trace if (e.phase is Phase.OPTIMIZER and (-1, "optimizer", "optimizer.step") in ops)
              or (e.phase is not Phase.OPTIMIZER and e.micro_batch in walked)]
    counts: dict[tuple[int, str, str], int] = {}
    for e in events:
        k = _key(e)
        counts[k] = counts.get(k, 0) + 1
    seen: dict[tuple[int, str, str], int] = {}
    last = min((a for a, _ in ops.values()), default=0.0)
    for e in events:
        k = _key(e)
        if k in ops:
            a, b = ops[k]
            n = seen.get(k, 0)
            seen[k] = n + 1
            last = max(last, a + (b - a) * n / counts[k])
        memory.append(MemorySample(rank.index, last, e.live_bytes, f"{e.phase.value} {e.op} (micro-batch {e.micro_batch + 1})"))


def _key(e: TraceEvent) -> tuple[int, str, str]:
    if e.phase is Phase.OPTIMIZER:
        return (-1, "optimizer", e.op)
    return (e.micro_batch, e.phase.value, e.op)
