"""The step program of a pipeline-parallel plan: one ``RankProgram`` per stage, and the step's time
as the pipeline's timeline.

Each pipeline rank runs its stage's graph (``planner.graph.stages``: cut from the rank's tensor-,
context- and expert-parallel graph), holds its stage's parameters and their data-parallel state,
and walks its schedule's events in torch's order (``planner.plan.pipeline_plan.rank_schedule``):
micro-batches in flight at once, each held until its backward. The ``world_size / pp`` ranks of
one stage (its data- and tensor-parallel group) run the same program.

Time: the stages' forward and backward per micro-batch (their op times, recompute included) run
in the schedule's order with the pipeline's waits (``planner.timing.pipeline_time``), activations
and gradients sent between stages over NVLink inside a node or the NICs across nodes
(``hardware.collectives.ring_time_s`` of a two-rank permute: NCCL's send/recv). After the span, the slowest rank's optimizer step and the
most any rank's data-parallel collectives add beyond its last backward (each placed on that
rank's own timeline, ``planner.program.step_program.placed``): a stage's gradient sync runs after
its last backward, which the first stage finishes last. Under FSDP2 a stage's collectives come
once per step (``RankProgram.once``, the strategy's ``once_per_step``): its all-gathers around its
first forward, its reduce-scatters after its last backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from hardware.collectives import Collective, ring_time_s
from hardware.profile import HardwareProfile
from planner.graph.layer_graph import LayerGraph
from planner.graph.stages import STAGE_INPUT, StageSpan, stage_graph
from planner.memory.types import Phase, Timeline
from planner.parallel.strategies import strategy_for
from planner.plan.knobs import Knobs
from planner.plan.pipeline_plan import rank_schedule, stage_spans
from planner.plan.pipeline_schedules import rank_stages
from planner.plan.schedule import Schedule, accumulation
from planner.program.step_program import RankProgram, StepProgram, device_bytes, placed, plus
from planner.timing.op_times import TimeBreakdown, step_time
from planner.timing.pipeline_time import PipelineTime, StageTime, pipeline_time
from planner.timing.timeline import RankTimeline, Stream


def stage_graphs(whole: LayerGraph, knobs: Knobs) -> tuple[tuple[StageSpan, LayerGraph], ...]:
    """Each pipeline stage's blocks and graph, first stage first (``pp x pp_virtual`` of them)."""
    spans = stage_spans(knobs.parallel.pp * knobs.pp_virtual, whole.model.n_layers, knobs.pp_layers)
    return tuple((span, stage_graph(whole, span)) for span in spans)


def stage_schedule(knobs: Knobs, rank: int) -> Schedule:
    """Pipeline rank ``rank``'s events: a stage's gradients are reduced once per step, on its last
    backward (DDP and ZeRO-1: ``no_sync`` on the others; FSDP2: ``perform_reduce_grad`` after it)."""
    dims = knobs.parallel
    sync_last = dims.data_parallel > 1
    return rank_schedule(knobs.pp_schedule, dims.pp, knobs.grad_accum_steps, rank, sync_last, knobs.pp_virtual)


def pipeline_ranks(whole: LayerGraph, knobs: Knobs, hw: HardwareProfile,
                   one_stage: Callable[[LayerGraph, Schedule, StageSpan], RankProgram]) -> tuple[RankProgram, ...]:
    """Every pipeline rank's program, first rank first: its stages (``rank_stages``: one, or
    several for a looped schedule), each built by ``one_stage`` with its receive buffers and the
    collectives the data-parallel strategy issues once per step for it, merged."""
    stages = stage_graphs(whole, knobs)
    held = rank_stages(knobs.pp_schedule, knobs.parallel.pp, knobs.pp_virtual)
    strategy = strategy_for(knobs.parallel)
    out = []
    for rank, indices in enumerate(held):
        schedule = stage_schedule(knobs, rank)
        parts = [with_receive_buffers(one_stage(stages[s][1], schedule, stages[s][0]), knobs, hw) for s in indices]
        parts = [replace(p, once=strategy.once_per_step(p.graph, hw, knobs)) for p in parts]
        out.append(_merged(parts))
    return tuple(out)


def _merged(parts: list[RankProgram]) -> RankProgram:
    """One rank holding several stages: their static memory together (the optimizer step's
    temporaries the largest part's: torchtitan keeps one optimizer per model part and steps them
    one by one; the engine every stage's), their collectives and optimizer steps one after the
    other (each stage's ``once`` collectives stay its own)."""
    if len(parts) == 1:
        return parts[0]
    statics = [p.static for p in parts]
    static = replace(statics[0], **{name: sum(getattr(s, name) for s in statics) for name in
                                    ("params_bytes", "optimizer_bytes", "grads_bytes", "received_bytes")},
                     optimizer_step_temp_bytes=max(s.optimizer_step_temp_bytes for s in statics),
                     engine=statics[0].engine.joined([s.engine for s in statics[1:]]))
    collectives = functools.reduce(plus, (p.collectives for p in parts))
    optimizer_s = (sum(p.optimizer_s[0] for p in parts), sum(p.optimizer_s[1] for p in parts))
    return replace(parts[0], static=static, collectives=collectives, optimizer_s=optimizer_s, others=tuple(parts[1:]))


def with_receive_buffers(rank: RankProgram, knobs: Knobs, hw: HardwareProfile) -> RankProgram:
    """``rank`` with its stage's receive buffers in its static memory: one activation per
    micro-batch on a stage after the first, one gradient of its output per micro-batch on a stage
    before the last, allocated at the first step and kept (``docs/pipeline_memory.md`` section 2:
    ``stage.py`` ``_setup_forward_recv_info`` / ``_create_grad_recv_info``)."""
    graph, m = rank.graph, knobs.grad_accum_steps
    received = 0
    if STAGE_INPUT in graph.ops:
        received += m * hw.round_alloc(graph.node(STAGE_INPUT).cost.output.n_bytes)
    if graph.output_grad_received:
        received += m * hw.round_alloc(graph.node(graph.order[-1]).cost.output.n_bytes)
    return replace(rank, static=replace(rank.static, received_bytes=received))


def p2p_seconds(program: StepProgram, knobs: Knobs, hw: HardwareProfile) -> float:
    """One activation (or gradient) send between adjacent stages: the boundary tensor of the
    second stage, over NVLink when every stage of a pipeline group sits in one node, else the
    NICs (mesh ``[pp, ...]``: a pipeline group's ranks are ``world_size / pp`` apart)."""
    dims = knobs.parallel
    if dims.pp < 2:
        return 0.0
    n_bytes = program.ranks[1].graph.node(STAGE_INPUT).cost.output.n_bytes
    stride = dims.world_size // dims.pp
    same_node = stride * dims.pp <= hw.gpus_per_node
    # NCCL send/recv between two ranks: one step of a two-rank ring (a permute of both buffers)
    return ring_time_s(2 * n_bytes, Collective.PERMUTE, hw, 2, 2 if same_node else 1)


def pipelined_time(program: StepProgram, knobs: Knobs, recomputed: tuple[frozenset[str], ...],
                   whole: bool = True) -> TimeBreakdown:
    """The busiest rank's step on the pipeline's timeline (see the module docstring): its compute,
    what its collectives add, and the rest of the span as the pipeline's bubble and waits."""
    computes = [_rank_compute(rank, ops, knobs) for ops, rank in zip(recomputed, program.ranks, strict=True)]
    line = _line(program, knobs, recomputed, whole)  # not whole: extrapolated, no timeline (the search's)
    exposed = max(placed(c, rank, program.hw).communication_s for c, rank in zip(computes, program.ranks, strict=True))
    own = computes[max(range(len(computes)), key=lambda r: line.busy_s[r])]
    step_s = line.step_time_s + max(c.optimizer_s for c in computes) + exposed
    compute_s = own.forward_s + own.backward_s + own.recompute_s + own.optimizer_s
    return own.model_copy(update={
        "communication_s": exposed, "step_time_s": step_s, "pipeline_bubble_s": step_s - compute_s - exposed,
        "lower_bound_s": max(c.lower_bound_s for c in computes), "timeline": line.timeline})


def _stage_compute(part: RankProgram, recomputed: frozenset[str]) -> TimeBreakdown:
    """One stage's compute for one micro-batch (no optimizer)."""
    return step_time(part.times, recomputed, accumulation(1), (0.0, 0.0))


def _rank_compute(rank: RankProgram, recomputed: frozenset[str], knobs: Knobs) -> TimeBreakdown:
    """A rank's compute over the step: each of its stages' micro-batches, and its optimizer step."""
    m = knobs.grad_accum_steps
    parts = [_stage_compute(p, recomputed) for p in (rank, *rank.others)]
    total = {name: m * sum(getattr(c, name) for c in parts)
             for name in ("forward_s", "backward_s", "recompute_s", "tensor_parallel_s", "context_parallel_s",
                          "expert_parallel_s", "lower_bound_s")}
    total["lower_bound_s"] += rank.optimizer_s[1]
    step_s = total["forward_s"] + total["backward_s"] + total["recompute_s"] + rank.optimizer_s[0]
    return TimeBreakdown(**total, optimizer_s=rank.optimizer_s[0], step_time_s=step_s)


def _weight_share(graph: LayerGraph) -> float:
    """The share of a stage's backward that computes weight gradients: its weight-gradient FLOPs
    over its backward FLOPs (a split backward's ``W`` runs those, ``I`` the rest and the recompute)."""
    nodes = [op.cost for op in graph.nodes if op.cost.has_backward]
    total = sum(c.bwd_flops for c in nodes)
    return sum(c.bwd_weight_flops for c in nodes) / total if total else 0.0


def _line(program: StepProgram, knobs: Knobs, recomputed: tuple[frozenset[str], ...],
          whole: bool = True) -> PipelineTime:
    """The schedule's tasks with each global stage's time per micro-batch."""
    held = rank_stages(knobs.pp_schedule, knobs.parallel.pp, knobs.pp_virtual)
    by_stage: dict[int, StageTime] = {}
    for rank, ops, indices in zip(program.ranks, recomputed, held, strict=True):
        for part, stage in zip((rank, *rank.others), indices, strict=True):
            c = _stage_compute(part, ops)
            weight = _weight_share(part.graph) * c.backward_s  # the dW half of a split backward
            by_stage[stage] = StageTime(forward_s=c.forward_s, backward_input_s=c.backward_s - weight + c.recompute_s,
                                        backward_weight_s=weight)
    times = tuple(by_stage[s] for s in range(len(by_stage)))
    return pipeline_time(knobs.pp_schedule, knobs.parallel.pp, knobs.grad_accum_steps, times,
                         p2p_seconds(program, knobs, program.hw), virtual=knobs.pp_virtual,
                         slowdown=program.hw.overlap_compute_slowdown, whole=whole)


class StageEstimate(BaseModel):
    """One pipeline rank (its stage, or its stages under a looped schedule), as the ranks of its
    data- and tensor-parallel group run it: its blocks, its peak, its share of the step."""

    model_config = ConfigDict(frozen=True)
    rank: int  # its place in the pipeline
    stages: tuple[int, ...]  # the global stages it runs
    blocks: tuple[tuple[int, int], ...]  # each stage's (first, last) block
    n_params: int  # its parameters (a tied embedding counted on both ends)
    params_bytes: int  # its parameters (and buffers) on one rank
    peak_allocated_bytes: int
    device_bytes: int
    peak_phase: Phase
    peak_op: str
    peak_micro_batch: int
    busy_s: float  # its forward and backward compute in the pipeline's span
    idle_s: float  # the span's rest: the bubble and waits for sends


def stage_estimates(program: StepProgram, knobs: Knobs, walks: tuple[Timeline, ...],
                    line: RankTimeline) -> tuple[StageEstimate, ...]:
    """Every pipeline rank's figures, first rank first (``walks``: each rank's memory walk;
    ``line``: the pipeline's timeline that ``pipelined_time`` placed, its compute and idle per rank)."""
    held = rank_stages(knobs.pp_schedule, knobs.parallel.pp, knobs.pp_virtual)
    out = []
    for i, (rank, walk) in enumerate(zip(program.ranks, walks, strict=True)):
        out.append(StageEstimate(
            rank=i, stages=held[i], blocks=tuple((s.first_block, s.last_block) for s in rank.spans),
            n_params=sum(g.n_params for g in rank.graphs), params_bytes=rank.static.params_bytes, peak_allocated_bytes=walk.peak.bytes,
            device_bytes=device_bytes(walk.peak.bytes, program.hw), peak_phase=walk.peak.phase,
            peak_op=walk.peak.op, peak_micro_batch=walk.peak.micro_batch,
            busy_s=line.busy_s(Stream.COMPUTE, i), idle_s=line.idle_s(i)))
    return tuple(out)
