"""Op times from the roofline, and a step's compute time summed over its schedule.

Per op: ``max(flops / (peak * eff_compute), bytes / (bw * eff_memory)) + launches``, forward and
backward separately (docs/design.md "Time"); a step's compute is ``grad_accum_steps x (forward +
backward + recompute)`` plus the optimizer step (memory-bound: it streams parameters, gradients and
state). The lower bound is the same sum with ideal peaks and no launch overhead. What the
data-parallel collectives add is read off the rank's timeline (``planner.timing.step_time``).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from hardware.collectives import collective_lower_bound_s, collective_time_s
from hardware.dtypes import ComputePrecision, DType
from hardware.kernels import AttentionKernel, Direction, MemoryClass, gemm_shape_factor, pick_curve
from hardware.profile import DeviceKind, HardwareProfile
from hardware.roofline import Bound, OpTime, op_time
from planner.graph.layer_graph import GraphNode, LayerGraph
from planner.memory.types import Phase
from planner.ops.base import CollectiveCall, LayerCost, MeshDim, OpKind
from planner.plan.optimizer import OptimizerSpec
from planner.plan.schedule import Schedule
from planner.timing.timeline import RankTimeline

# torch's multi_tensor_apply launches one kernel per chunk of at most 36 tensors when four
# tensor lists are passed (aten/src/ATen/native/cuda/MultiTensorApply.cuh depth_to_max_tensors).
_TENSORS_PER_FOREACH_LAUNCH = 36
# the precisions the published attention curves were measured in (fp8-mixed keeps attention in bf16)
_CURVE_PRECISIONS = frozenset({ComputePrecision.BF16, ComputePrecision.FP16, ComputePrecision.FP8})


class OpRoofline(BaseModel):
    """One op's roofline, per micro-batch."""

    model_config = ConfigDict(frozen=True)
    name: str
    kind: str
    block: int | None
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    intensity_flops_per_byte: float
    bound: Bound
    fwd_time_s: float
    bwd_time_s: float
    lower_bound_s: float

    @property
    def time_s(self) -> float:
        return self.fwd_time_s + self.bwd_time_s


class OpGroup(BaseModel):
    """One op type summed over the blocks and micro-batches of a step (``attn.q_proj`` x L)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    name: str
    kind: str
    count: int
    flops: float
    bytes_moved: float
    intensity_flops_per_byte: float | None = Field(
        description="flops / bytes_moved; None when the group moves no bytes (no finite intensity: unbounded with "
                    "FLOPs, undefined without), so a plan file and --json stay finite JSON")
    bound: Bound
    time_s: float
    lower_bound_s: float


def group_key(name: str) -> str:
    """``blocks.3.attn.q_proj`` -> ``attn.q_proj``; model-level ops keep their name."""
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "blocks" and len(parts) > 2 else name


def group_ops(ops: tuple[OpRoofline, ...], grad_accum_steps: int) -> tuple[OpGroup, ...]:
    """Sum the per-op roofline by op type over a whole step; slowest first."""
    groups: dict[str, list[OpRoofline]] = {}
    for op in ops:
        groups.setdefault(group_key(op.name), []).append(op)
    out = []
    for key, members in groups.items():
        flops = grad_accum_steps * sum(o.fwd_flops + o.bwd_flops for o in members)
        n_bytes = grad_accum_steps * sum(o.fwd_bytes + o.bwd_bytes for o in members)
        time_s = grad_accum_steps * sum(o.time_s for o in members)
        by_bound = {b: sum(o.time_s for o in members if o.bound is b) for b in Bound}
        out.append(
            OpGroup(
                name=key,
                kind=members[0].kind,
                count=len(members),
                flops=flops,
                bytes_moved=n_bytes,
                intensity_flops_per_byte=flops / n_bytes if n_bytes else None,
                bound=max(by_bound, key=lambda b: by_bound[b]),
                time_s=time_s,
                lower_bound_s=grad_accum_steps * sum(o.lower_bound_s for o in members),
            )
        )
    return tuple(sorted(out, key=lambda g: g.time_s, reverse=True))


class TimeBreakdown(BaseModel):
    """One rank's step time, by what it is spent on (``step_time_s`` is its timeline's span once
    the collectives are placed, ``planner.timing.step_time``)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    forward_s: float
    backward_s: float
    recompute_s: float
    optimizer_s: float
    communication_s: float = 0.0  # data parallelism: what its collectives add beyond the compute they overlap
    tensor_parallel_s: float = 0.0  # tensor parallelism's collectives, on the critical path (inside forward/backward)
    context_parallel_s: float = 0.0  # what the ring attention's collectives add beyond the blocks they overlap
    expert_parallel_s: float = 0.0  # expert parallelism's all-to-alls, on the critical path
    pipeline_bubble_s: float = 0.0  # pipeline parallelism: the busiest rank's idle in the span (bubble, sends)
    step_time_s: float
    lower_bound_s: float
    timeline: RankTimeline | None = Field(default=None, exclude=True, repr=False)  # tasks, streams, critical path


class _Timed(BaseModel):
    """One op's forward and backward times (collectives included) and what context
    parallelism's collectives add to each."""

    model_config = ConfigDict(frozen=True)
    fwd: OpTime
    bwd: OpTime
    bwd_flops: float
    bwd_bytes: float
    fwd_cp_s: float = 0.0
    bwd_cp_s: float = 0.0
    fwd_ep_s: float = 0.0
    bwd_ep_s: float = 0.0


def op_roofline(op: GraphNode, precision: ComputePrecision, hw: HardwareProfile) -> OpRoofline:
    """One op's roofline (built without re-validation: every input is already validated)."""
    return _roofline(op, _cost_times(op, precision, hw))


def op_rooflines_of(ops: tuple[GraphNode, ...], precision: ComputePrecision, hw: HardwareProfile) -> tuple[OpRoofline, ...]:
    """Rooflines of many ops; identical blocks share their cost objects, so each distinct cost
    is timed once."""
    timed: dict[int, _Timed] = {}
    out = []
    for op in ops:
        key = id(op.cost)
        if key not in timed:
            timed[key] = _cost_times(op, precision, hw)
        out.append(_roofline(op, timed[key]))
    return tuple(out)


def kernel_rate(cost: LayerCost, precision: ComputePrecision, hw: HardwareProfile,
                direction: Direction) -> float | None:
    """The FLOP/s this op's kernel reaches (``hardware.kernels``), or None for the profile's
    large-GEMM rate: a GEMM's shape factor; attention's published curve of its kernel (fused
    kernels at bf16/fp16 only: fp32 attention falls back, and under fp8-mixed attention stays
    in bf16, which is what the curves measure)."""
    if not cost.matmul:
        return None
    if cost.attention is not None:
        shape = cost.attention
        kernel = (shape.kernel or hw.attention_kernel) if shape.fused else AttentionKernel.MATH
        if precision not in _CURVE_PRECISIONS:
            return None
        curve = pick_curve(hw.attention_curves, kernel, shape.causal, shape.head_dim, direction)
        if curve is None:
            return None
        if cost.ring_ranks == 1:
            return curve.flops_per_s(shape.seq_len)
        # a ring: the causal diagonal block is 1/cp of the executed FLOPs, the rest non-causal
        # blocks (a half of the queries against the whole shard), at the curves' rates for the
        # shard's length
        full = pick_curve(hw.attention_curves, kernel, False, shape.head_dim, direction) or curve
        share = 1 / cost.ring_ranks
        return 1 / (share / curve.flops_per_s(shape.seq_len) + (1 - share) / full.flops_per_s(shape.seq_len))
    if cost.gemm is not None:
        return hw.achievable_flops_per_s(precision) * gemm_shape_factor(cost.gemm, hw.gemm_half_dim)
    return None


# which class of memory-bound kernel each op family runs (docs/kernel_benchmarks.md 3.2)
MEMORY_CLASS: dict[OpKind, MemoryClass] = {
    OpKind.LAYERNORM: MemoryClass.NORM,
    OpKind.RMSNORM: MemoryClass.NORM,
    OpKind.RESIDUAL_ADD: MemoryClass.ELEMENTWISE,
    OpKind.GELU: MemoryClass.ELEMENTWISE,
    OpKind.SILU: MemoryClass.ELEMENTWISE,
    OpKind.GLU_MUL: MemoryClass.ELEMENTWISE,
    OpKind.DROPOUT: MemoryClass.ELEMENTWISE,
    OpKind.ROTARY: MemoryClass.ELEMENTWISE,
    OpKind.CROSS_ENTROPY: MemoryClass.SOFTMAX,
}


def _cost_times(op: GraphNode, precision: ComputePrecision, hw: HardwareProfile) -> _Timed:
    cost = op.cost
    compute = precision if cost.matmul else ComputePrecision.FP32
    memory = MEMORY_CLASS.get(op.spec.kind, MemoryClass.STREAM)
    fwd = op_time(cost.fwd_exec, cost.fwd_bytes_moved, compute, hw, cost.fwd_kernels,
                  kernel_rate(cost, compute, hw, Direction.FWD), memory)
    bwd_flops = cost.bwd_exec if cost.has_backward else 0.0
    bwd_bytes = cost.bwd_bytes_moved if cost.has_backward else 0.0
    bwd = op_time(bwd_flops, bwd_bytes, compute, hw, cost.bwd_kernels if cost.has_backward else 0,
                  kernel_rate(cost, compute, hw, Direction.BWD) if bwd_flops else None, memory)
    fwd, fwd_cp, fwd_ep = _with_collectives(_in_a_step(fwd, hw), cost.fwd_collectives, hw)
    bwd, bwd_cp, bwd_ep = _with_collectives(_in_a_step(bwd, hw), cost.bwd_collectives if cost.has_backward else (), hw)
    return _Timed(fwd=fwd, bwd=bwd, bwd_flops=bwd_flops, bwd_bytes=bwd_bytes, fwd_cp_s=fwd_cp, bwd_cp_s=bwd_cp,
                  fwd_ep_s=fwd_ep, bwd_ep_s=bwd_ep)


def _with_collectives(timed: OpTime, calls: tuple[CollectiveCall, ...], hw: HardwareProfile
                      ) -> tuple[OpTime, float, float]:
    """Add what the collectives an op runs put on its critical path (NCCL's model of each, less
    the share of the op's kernel time it runs beside, ``overlap``; the ring bytes term at full
    link speed to the lower bound), and return its context- and expert-parallel parts. Not scaled by
    ``step_efficiency``: that is the kernels' share."""
    if not calls:
        return timed, 0.0, 0.0
    exposed = ideal = cp = ep = 0.0
    for call in calls:
        comm_s, _ = collective_time_s(call.n_bytes, call.kind, hw, call.group_size, call.ranks_per_node)
        waited = call.calls * max(0.0, comm_s - call.overlap * timed.time_s)
        exposed += waited
        ideal += call.calls * max(0.0, collective_lower_bound_s(call.n_bytes, call.kind, hw, call.group_size,
                                                                call.ranks_per_node)
                                  - call.overlap * timed.lower_bound_s)
        if call.dimension is MeshDim.CP:
            cp += waited
        elif call.dimension is MeshDim.EP:
            ep += waited
    return timed.model_copy(update={"time_s": timed.time_s + exposed, "lower_bound_s": timed.lower_bound_s + ideal,
                                    "communication_time_s": exposed}), cp, ep


def _in_a_step(timed: OpTime, hw: HardwareProfile) -> OpTime:
    """An op inside a real training step runs at the profile's ``step_efficiency`` of its
    isolated kernel time (the lower bound is untouched)."""
    if hw.step_efficiency == 1.0:
        return timed
    return timed.model_copy(update={"time_s": timed.time_s / hw.step_efficiency})


def _roofline(op: GraphNode, times: _Timed) -> OpRoofline:
    fwd, bwd, bwd_flops, bwd_bytes = times.fwd, times.bwd, times.bwd_flops, times.bwd_bytes
    cost = op.cost
    total_flops = cost.fwd_exec + bwd_flops
    total_bytes = cost.fwd_bytes_moved + bwd_bytes
    compute_bound = fwd.compute_time_s + bwd.compute_time_s >= fwd.memory_time_s + bwd.memory_time_s
    communication_s = fwd.communication_time_s + bwd.communication_time_s
    if communication_s > fwd.time_s + bwd.time_s - communication_s:
        bound = Bound.COMMUNICATION
    else:
        bound = Bound.COMPUTE if compute_bound and total_flops > 0 else Bound.MEMORY
    return OpRoofline.model_construct(
        name=op.spec.name,
        kind=op.spec.kind.value,
        block=op.spec.block,
        fwd_flops=cost.fwd_flops,
        bwd_flops=cost.bwd_flops if cost.has_backward else 0.0,
        fwd_bytes=cost.fwd_bytes_moved,
        bwd_bytes=bwd_bytes,
        intensity_flops_per_byte=total_flops / total_bytes if total_bytes else math.inf,
        bound=bound,
        fwd_time_s=fwd.time_s,
        bwd_time_s=bwd.time_s,
        lower_bound_s=fwd.lower_bound_s + bwd.lower_bound_s,
    )


def optimizer_time_s(
    graph: LayerGraph, optimizer: OptimizerSpec, hw: HardwareProfile, shard_fraction: float = 1.0,
    state_dtype: DType | None = None,
) -> tuple[float, float]:
    """(estimate, lower bound) of one optimizer step: memory-bound streaming of its state, in
    ``state_dtype`` (default: the graph's parameter dtype)."""
    elements = graph.n_trainable_params * shard_fraction  # frozen parameters are not stepped
    n_bytes = optimizer.traffic_elements_per_param * elements * (state_dtype or graph.precision.param_dtype).n_bytes
    n_tensors = len(graph.trainable_tensors)
    if hw.kind is DeviceKind.CPU:
        # torch has no multi-tensor kernels on the CPU: _foreach_* ops loop over the tensors
        # (aten/src/ATen/native/ForeachOpsKernels.cpp, the "slow" path), and fused steps do too
        launches = optimizer.kernels_per_tensor_list * n_tensors
    else:
        launches = optimizer.kernels_per_tensor_list * max(1, math.ceil(n_tensors / _TENSORS_PER_FOREACH_LAUNCH))
    timing = op_time(0.0, n_bytes, ComputePrecision.FP32, hw, launches)
    return timing.time_s, timing.lower_bound_s


class OpTimes(BaseModel):
    """Per-op times of one micro-batch, as plain sequences (what the search sums)."""

    model_config = ConfigDict(frozen=True)
    names: tuple[str, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    lower_bound_s: tuple[float, ...]  # forward and backward
    fwd_lower_bound_s: tuple[float, ...]
    fwd_comm_s: tuple[float, ...] = ()  # of fwd_s: the collectives the op waits for
    bwd_comm_s: tuple[float, ...] = ()
    fwd_cp_s: tuple[float, ...] = ()  # of those: context parallelism's
    bwd_cp_s: tuple[float, ...] = ()
    fwd_ep_s: tuple[float, ...] = ()  # ... and expert parallelism's
    bwd_ep_s: tuple[float, ...] = ()


def op_times(ops: tuple[GraphNode, ...], precision: ComputePrecision, hw: HardwareProfile) -> OpTimes:
    """Forward, backward and lower-bound time of every op (each distinct cost timed once)."""
    timed: dict[int, _Timed] = {}
    fwd, bwd, lower, fwd_lower, fwd_comm, bwd_comm, fwd_cp, bwd_cp = [], [], [], [], [], [], [], []
    fwd_ep: list[float] = []
    bwd_ep: list[float] = []
    for op in ops:
        key = id(op.cost)
        if key not in timed:
            timed[key] = _cost_times(op, precision, hw)
        t = timed[key]
        f, b = t.fwd, t.bwd
        fwd.append(f.time_s)
        bwd.append(b.time_s)
        lower.append(f.lower_bound_s + b.lower_bound_s)
        fwd_lower.append(f.lower_bound_s)
        fwd_comm.append(f.communication_time_s)
        bwd_comm.append(b.communication_time_s)
        fwd_cp.append(t.fwd_cp_s)
        bwd_cp.append(t.bwd_cp_s)
        fwd_ep.append(t.fwd_ep_s)
        bwd_ep.append(t.bwd_ep_s)
    return OpTimes.model_construct(names=tuple(op.spec.name for op in ops), fwd_s=tuple(fwd), bwd_s=tuple(bwd),
                                   lower_bound_s=tuple(lower), fwd_lower_bound_s=tuple(fwd_lower),
                                   fwd_comm_s=tuple(fwd_comm), bwd_comm_s=tuple(bwd_comm), fwd_cp_s=tuple(fwd_cp),
                                   bwd_cp_s=tuple(bwd_cp), fwd_ep_s=tuple(fwd_ep), bwd_ep_s=tuple(bwd_ep))


def step_time(
    times: OpTimes,
    recomputed: frozenset[str],
    schedule: Schedule,
    optimizer_s: tuple[float, float],
) -> TimeBreakdown:
    """The sum over the schedule's events: every forward event runs the ops' forwards, every
    backward event their backwards and the checkpointed ops' forwards again, the optimizer event
    the optimizer step (every micro-batch has the same shapes, so each event costs the same)."""
    forward = sum(times.fwd_s)
    backward = sum(times.bwd_s)
    recompute = sum(t for name, t in zip(times.names, times.fwd_s, strict=True) if name in recomputed)
    fwd_lower = sum(times.fwd_lower_bound_s)  # recomputation is not required work: not in the bound
    bwd_lower = sum(times.lower_bound_s) - fwd_lower
    n_fwd, n_bwd = schedule.count(Phase.FORWARD), schedule.count(Phase.BACKWARD)
    comm_fwd, comm_bwd = sum(times.fwd_comm_s), sum(times.bwd_comm_s)
    comm_re = sum(t for name, t in zip(times.names, times.fwd_comm_s, strict=True) if name in recomputed)
    cp_fwd, cp_bwd = sum(times.fwd_cp_s), sum(times.bwd_cp_s)
    cp_re = sum(t for name, t in zip(times.names, times.fwd_cp_s, strict=True) if name in recomputed)
    context = n_fwd * cp_fwd + n_bwd * (cp_bwd + cp_re)
    ep_re = sum(t for name, t in zip(times.names, times.fwd_ep_s, strict=True) if name in recomputed)
    experts = n_fwd * sum(times.fwd_ep_s) + n_bwd * (sum(times.bwd_ep_s) + ep_re)
    return TimeBreakdown(
        forward_s=n_fwd * forward,
        backward_s=n_bwd * backward,
        recompute_s=n_bwd * recompute,
        optimizer_s=optimizer_s[0],
        tensor_parallel_s=n_fwd * comm_fwd + n_bwd * (comm_bwd + comm_re) - context - experts,
        context_parallel_s=context,
        expert_parallel_s=experts,
        step_time_s=n_fwd * forward + n_bwd * (backward + recompute) + optimizer_s[0],
        lower_bound_s=n_fwd * fwd_lower + n_bwd * bwd_lower + optimizer_s[1],
    )
