"""The step program of one plan point: what every rank runs, in what order, holding what.

A ``StepProgram`` is built once per point (``planner.program.estimate.step_program``) and shared by
everything that prices it: the memory walk (``walk``: the one event loop of
``planner.memory.step.simulate_step`` over the rank's graph, its engine's hooks and the schedule), the
step time (``time``: the rank's timeline, ``planner.timing.step_time``) and the search, which walks
the same program with other checkpoint placements. Each ``RankProgram`` is one kind of rank:
its graph (its share of the model: the tensor-, context- and expert-parallel shard of its
stage(s)), its static memory and engine, its schedule, its collectives and how many ranks run
it. Without pipeline parallelism every rank runs the same program, so there is one, run by every
GPU; with it, one per stage (``planner.program.pipeline_program``). FLOPs are counted per rank
kind, times the ranks that run it, so a stage's logits and loss are counted only where they run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hardware.profile import HardwareProfile
from planner.graph.layer_graph import LayerGraph
from planner.graph.stages import StageSpan
from planner.memory.engine import StaticMemory
from planner.memory.step import simulate_step
from planner.memory.types import Live, Phase, Timeline
from planner.ops.base import OpVariant
from planner.plan.schedule import Event, Schedule
from planner.timing.op_times import OpTimes, TimeBreakdown, step_time
from planner.timing.step_time import NO_COLLECTIVES, Collectives, rank_timeline
from planner.timing.timeline import RankTimeline


@dataclass(frozen=True)
class RankProgram:
    """One kind of rank: what it holds and runs in a step, and how many ranks run it."""

    graph: LayerGraph  # its share of the model, per micro-batch
    static: StaticMemory  # what it holds for the whole step, and its engine
    schedule: Schedule  # its (micro-batch, phase) events
    collectives: Collectives  # its data-parallel collectives around each micro-batch
    times: OpTimes  # its ops' times for one micro-batch
    optimizer_s: tuple[float, float]  # its optimizer step (estimate, lower bound)
    ranks: int  # ranks that run this program
    stage: StageSpan | None = None  # the pipeline stage it runs (None: the whole model)
    # a looped pipeline schedule's further stages on this rank, each as its own program (its graph,
    # op times, static memory); this one's static memory, collectives and optimizer are then the
    # whole rank's (``planner.program.pipeline_program``)
    others: tuple[RankProgram, ...] = ()
    # a pipeline stage's collectives issued once per step, its own (not the rank's): the forward ones
    # around the stage's first forward, the backward ones around its syncing (last) backward (FSDP2
    # under a pipeline: the stage's all-gathers and reduce-scatters, ``Fsdp2.once_per_step``)
    once: Collectives = NO_COLLECTIVES

    @property
    def graphs(self) -> tuple[LayerGraph, ...]:
        """Its stages' graphs, ``graph`` first (one without pipeline parallelism)."""
        return (self.graph, *(o.graph for o in self.others))

    @property
    def spans(self) -> tuple[StageSpan, ...]:
        return tuple(s for s in (self.stage, *(o.stage for o in self.others)) if s is not None)

    def model_flops_per_step(self) -> float:
        """FLOPs of this rank's step: each stage's micro-batch times its forwards."""
        return sum(self.schedule.count(Phase.FORWARD, i if self.others else None) * _model_flops(g)
                   for i, g in enumerate(self.graphs))

    def executed_flops_per_step(self, recompute_flops: float) -> float:
        """FLOPs its kernels run in a step, replicated work included; ``recompute_flops``: one
        micro-batch's recompute summed over its stages."""
        forwards = self.schedule.count(Phase.FORWARD, 0 if self.others else None)
        return sum(self.schedule.count(Phase.FORWARD, i if self.others else None) * _executed_flops(g)
                   for i, g in enumerate(self.graphs)) + forwards * recompute_flops


def _model_flops(graph: LayerGraph) -> float:
    """FLOPs of one micro-batch of ``graph`` (FlopCounterMode's convention, no recompute); an op
    every rank of its group runs whole (a MoE router under TP) counted once per group."""
    total = 0.0
    for op in graph.nodes:
        if not op.cost.has_backward:
            continue
        flops = op.cost.fwd_flops + op.cost.bwd_flops
        if op.spec.variant is OpVariant.REPLICATED_WEIGHT:
            flops /= op.spec.group_size
        total += flops
    return total


def _executed_flops(graph: LayerGraph) -> float:
    """FLOPs ``graph``'s kernels run for one micro-batch, replicated work included (recompute not)."""
    return sum(op.cost.fwd_flops + op.cost.bwd_flops for op in graph.nodes if op.cost.has_backward)


@dataclass(frozen=True)
class StepProgram:
    """Every kind of rank of one plan point, and the hardware they run on."""

    ranks: tuple[RankProgram, ...]
    units: dict[int, int]  # the plan's checkpoint units (block -> unit)
    hw: HardwareProfile

    @property
    def busiest(self) -> RankProgram:
        return self.ranks[0]

    def walk(self, units: dict[int, int] | None = None, record_trace: bool = False,
             rank: RankProgram | None = None, live: Live | None = None) -> Timeline:
        """The memory walk of ``rank`` (default the busiest) with checkpoint ``units`` (default the
        plan's), into ``live`` if given (``simulate_step``)."""
        r = rank or self.busiest
        return simulate_step(r.graph, r.static, self.hw.round_alloc, self.units if units is None else units,
                             r.schedule, record_trace, tuple(o.graph for o in r.others), live)

    def compute_time(self, recomputed: frozenset[str], rank: RankProgram | None = None) -> TimeBreakdown:
        """``rank``'s compute when checkpointing re-runs the ``recomputed`` ops, summed over its
        schedule (no collectives placed yet: what every placement takes at least)."""
        r = rank or self.busiest
        return step_time(r.times, recomputed, r.schedule, r.optimizer_s)

    def placed(self, compute: TimeBreakdown, rank: RankProgram | None = None) -> TimeBreakdown:
        """``compute`` with ``rank``'s collectives placed on its timeline (``placed``)."""
        return placed(compute, rank or self.busiest, self.hw)

    def time(self, recomputed: frozenset[str], rank: RankProgram | None = None) -> TimeBreakdown:
        """``rank``'s step time when checkpointing re-runs the ``recomputed`` ops: its compute summed
        over its schedule, then its timeline with its collectives placed."""
        return self.placed(self.compute_time(recomputed, rank), rank)

    def model_flops_per_step(self) -> float:
        return sum(r.ranks * r.model_flops_per_step() for r in self.ranks)

    def hardware_flops_per_step(self, recompute_flops: dict[int, float]) -> float:
        """Executed FLOPs of every rank (``recompute_flops``: per rank kind's index, one micro-batch's)."""
        return sum(r.ranks * r.executed_flops_per_step(recompute_flops.get(i, 0.0)) for i, r in enumerate(self.ranks))

    @property
    def world_size(self) -> int:
        return sum(r.ranks for r in self.ranks)


def placed(compute: TimeBreakdown, rank: RankProgram, hw: HardwareProfile) -> TimeBreakdown:
    """``compute`` (the rank's compute time, summed over its schedule) with its collectives placed
    on its timeline: the step time is the timeline's span, the communication what that adds."""
    schedule = rank.schedule
    forward_s = compute.forward_s / schedule.count(Phase.FORWARD)
    backward_s = (compute.backward_s + compute.recompute_s) / schedule.count(Phase.BACKWARD)
    parts = (rank, *rank.others)
    if all(p.once.none for p in parts):
        timeline = rank_timeline(schedule, forward_s, backward_s, compute.optimizer_s, rank.collectives,
                                 hw.overlap_compute_slowdown)
    else:
        timeline = _with_once(schedule, forward_s, backward_s, compute.optimizer_s, rank.collectives,
                              tuple(p.once for p in parts), hw.overlap_compute_slowdown)
    if rank.collectives.none and all(p.once.none for p in parts):
        return compute.model_copy(update={"timeline": timeline})
    step_s = timeline.step_time_s
    return compute.model_copy(update={"communication_s": step_s - compute.step_time_s, "step_time_s": step_s,
                                      "timeline": timeline})


def plus(a: Collectives, b: Collectives) -> Collectives:
    """Both ``a``'s and ``b``'s collectives, one after the other where they sit."""
    return Collectives(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(Collectives)})


def _with_once(schedule: Schedule, forward_s: float, backward_s: float, optimizer_s: float, each: Collectives,
               once: tuple[Collectives, ...], slowdown: float) -> RankTimeline:
    """``rank_timeline`` with each stage's ``once`` collectives added around its first forward and
    its syncing backward (``RankProgram.once``); runs of events with the same collectives are
    placed together."""
    seen: set[int] = set()
    runs: list[tuple[Collectives, list[Event]]] = []
    for event in schedule.events:
        first = event.phase is Phase.FORWARD and event.stage not in seen
        if first:
            seen.add(event.stage)
        last = event.phase is Phase.BACKWARD and event.sync
        around = plus(each, once[event.stage]) if first or last else each
        if runs and runs[-1][0] == around:
            runs[-1][1].append(event)
        else:
            runs.append((around, [event]))
    segments = [seg for around, events in runs for seg in rank_timeline(
        Schedule(events=tuple(events), n_micro_batches=schedule.n_micro_batches), forward_s, backward_s, optimizer_s,
        around, slowdown).segments]
    return RankTimeline(segments=tuple(segments))


def device_bytes(peak_allocated_bytes: int, hw: HardwareProfile) -> int:
    """What the device needs for a peak: fragmentation allowance and runtime reserve added."""
    return int(peak_allocated_bytes * hw.fragmentation_factor) + hw.runtime_reserve_bytes
