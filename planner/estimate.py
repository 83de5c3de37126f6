"""``estimate``: the exact account of one configuration — FLOPs, memory timeline, step time.

FLOPs convention (README): ``model_flops_per_step`` counts every matmul and attention product
as ``torch.utils.flop_counter.FlopCounterMode`` does (2 per multiply-add, the full T x T
scores, backward = 2 x forward) and excludes recomputation; ``hardware_flops_per_step`` adds
the forward FLOPs that activation checkpointing runs again. MFU = model FLOPs / (step time x
dense peak of the plan's matmul precision x GPUs) (PaLM, Chowdhery et al. 2022, appendix B).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

from hardware.dtypes import DType
from hardware.profile import HardwareProfile
from hardware.roofline import Bound
from planner.cache import IdentityCache
from planner.config import ModelConfig, TrainConfig
from planner.errors import ConfigError, UnsupportedPrecisionError
from planner.fsdp import FSDP_PRECISIONS, FsdpLayout, fsdp_communication, fsdp_layout, fsdp_static, shard_fraction
from planner.graph import LayerGraph, build_graph
from planner.knobs import Knobs
from planner.memory import Category, Phase, StaticMemory, checkpoint_units, simulate_step, static_memory
from planner.ops.base import ParamTensor
from planner.optimizer import optimizer_spec
from planner.parallel import Communication, ParallelConfig, ddp_communication, zero1_partition
from planner.params import param_tensors
from planner.precision import PrecisionPolicy, PrecisionSpec, precision_spec
from planner.timing import (
    OpGroup,
    OpRoofline,
    OpTimes,
    TimeBreakdown,
    group_ops,
    op_rooflines_of,
    op_times,
    optimizer_time_s,
    step_time,
)


class MemoryBreakdown(BaseModel):
    """Memory of one steady-state step on one GPU."""

    model_config = ConfigDict(frozen=True)
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # saved for backward at the end of one micro-batch's forward, logits excluded
    logits_bytes: int  # logits-family tensors alive at the end of one micro-batch's forward
    data_bytes: int
    peak_allocated_bytes: int  # what torch.cuda.max_memory_allocated() would read
    device_bytes: int  # peak x fragmentation allowance + runtime reserve: checked against the cap
    hbm_cap_bytes: int
    fits: bool
    peak_phase: Phase
    peak_op: str
    peak_micro_batch: int
    at_peak: dict[Category, int]  # what is live at the peak, by category (sums to the peak)


class Estimate(BaseModel):
    """Predicted figures for one (model, workload, hardware, knobs)."""

    model_config = ConfigDict(frozen=True)
    hardware: str
    n_params: int
    step_time_s: float
    tokens_per_s: float
    mfu: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    time: TimeBreakdown
    memory: MemoryBreakdown
    op_groups: tuple[OpGroup, ...]  # the per-op roofline summed over blocks, slowest first
    limiting_bound: Bound
    ops: tuple[OpRoofline, ...] = Field(default=(), exclude=True, repr=False)  # every op, per micro-batch

    @property
    def fits(self) -> bool:
        return self.memory.fits


def compute_spec(knobs: Knobs) -> PrecisionSpec:
    """The precision the step computes in: the policy's, except that FSDP2 (ZeRO-2/3) runs
    bf16-mixed as ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: gathered bf16
    parameters and no autocast, i.e. the bf16-true graph (its fp32 master copies are the shards)."""
    if knobs.zero_stage >= 2 and knobs.precision is PrecisionPolicy.BF16_MIXED:
        return precision_spec(PrecisionPolicy.BF16_TRUE)
    return precision_spec(knobs.precision)


def check_knobs(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> PrecisionSpec:
    """Reject knobs that cannot describe this workload on this device; return the precision the
    step computes in (``compute_spec``: what the graph is built with)."""
    if knobs.sequences_per_step != training.global_batch_size:
        raise ConfigError(
            f"knobs: micro_batch_size {knobs.micro_batch_size} x grad_accum_steps {knobs.grad_accum_steps} x "
            f"data_parallel {knobs.data_parallel} = {knobs.sequences_per_step} sequences, but "
            f"training.global_batch_size is {training.global_batch_size}; choose a micro-batch that divides it"
        )
    if knobs.zero_stage and knobs.data_parallel == 1:
        raise ConfigError("knobs.zero_stage: sharding needs several GPUs; use zero_stage 0 with data_parallel 1")
    if knobs.zero_stage >= 2 and knobs.precision not in FSDP_PRECISIONS:
        runs = ", ".join(p.value for p in FSDP_PRECISIONS)
        raise ConfigError(
            f"knobs.precision: {knobs.precision.value} with ZeRO-{knobs.zero_stage} (FSDP2) is not modelled (FSDP2 "
            f"needs a sharded grad scaler for fp16 and Float8 training for fp8); use {runs}, or ZeRO-0/1"
        )
    if knobs.zero_stage >= 2 and knobs.checkpoint_segments:
        raise ConfigError(
            "knobs.checkpoint_segments: segments of several blocks under FSDP2 re-gather every block of a segment "
            "during its recompute, which is not modelled; checkpoint blocks one by one (checkpoint_blocks)"
        )
    outside = [b for b in knobs.checkpointed if b >= model.n_layers]
    if outside:
        raise ConfigError(
            f"knobs.checkpoint_blocks: block {outside[0]} does not exist; the model has blocks 0..{model.n_layers - 1}"
        )
    spec = compute_spec(knobs)
    if not hw.supports(spec.matmul_precision):
        runs = ", ".join(p.value for p in hw.precisions)
        raise UnsupportedPrecisionError(
            f"precision: {knobs.precision.value} needs {spec.matmul_precision.value} matmuls, which {hw.name} "
            f"does not run (it runs {runs})"
        )
    return spec


_ROOFLINES: IdentityCache[tuple[OpRoofline, ...]] = IdentityCache()
_GROUPS: IdentityCache[tuple[OpGroup, ...]] = IdentityCache()
_TIMES: IdentityCache[OpTimes] = IdentityCache()


@lru_cache(maxsize=64)
def cached_graph(model: ModelConfig, batch: int, seq_len: int, spec: PrecisionSpec) -> LayerGraph:
    return build_graph(model, batch, seq_len, spec)


def op_rooflines(graph: LayerGraph, hw: HardwareProfile) -> tuple[OpRoofline, ...]:
    """Every op's roofline for one micro-batch (cached per graph and device)."""
    precision = graph.precision.matmul_precision
    return _ROOFLINES.get((graph, hw), (), lambda: op_rooflines_of(graph.nodes, precision, hw))


def times_of(graph: LayerGraph, hw: HardwareProfile) -> OpTimes:
    """Per-op times for one micro-batch (cached per graph and device)."""
    return _TIMES.get((graph, hw), (), lambda: op_times(graph.nodes, graph.precision.matmul_precision, hw))


def timing(
    graph: LayerGraph, hw: HardwareProfile, training: TrainConfig, grad_accum_steps: int, recomputed: frozenset[str],
    shard_fraction: float = 1.0, state_dtype: DType | None = None,
) -> tuple[OpTimes, TimeBreakdown]:
    """Step time of a graph given which ops the checkpointing re-runs (no memory walk needed);
    ``shard_fraction`` of the parameters is what this rank's optimizer updates, stored in
    ``state_dtype`` (default: the graph's parameter dtype)."""
    times = times_of(graph, hw)
    opt = optimizer_spec(training.optimizer, training.optimizer_impl)
    return times, step_time(times, recomputed, grad_accum_steps,
                            optimizer_time_s(graph, opt, hw, shard_fraction, state_dtype))


def rank_timing(graph: LayerGraph, hw: HardwareProfile, training: TrainConfig, knobs: Knobs,
                recomputed: frozenset[str]) -> tuple[OpTimes, TimeBreakdown]:
    """``timing`` of one rank: its optimizer updates its own share, in the stored dtype."""
    return timing(graph, hw, training, knobs.grad_accum_steps, recomputed,
                  shard_fraction=optimizer_shard_fraction(graph, knobs, hw),
                  state_dtype=precision_spec(knobs.precision).param_dtype)


def optimizer_shard_fraction(graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> float:
    """The share of the parameters this rank's optimizer updates (ZeRO-1: its largest partition;
    FSDP2: its padded shards)."""
    if knobs.data_parallel == 1 or knobs.zero_stage == 0:
        return 1.0
    if knobs.zero_stage >= 2:
        return shard_fraction(layout_for(graph, knobs, hw), graph.n_params)
    partitions = zero1_partition(list(graph.param_specs.values()), knobs.data_parallel)
    return max(sum(p.numel for p in part) for part in partitions) / graph.n_params


def with_communication(graph: LayerGraph, hw: HardwareProfile, knobs: Knobs, gpus_per_node: int,
                       time: TimeBreakdown) -> TimeBreakdown:
    """The step time with the collectives compute does not hide (nothing to add on one GPU).
    Compute that collectives overlap runs ``overlap_compute_slowdown`` slower (the profile's
    published measurement), which also widens the windows that hide them."""
    if knobs.data_parallel == 1:
        return time
    slow = 1.0 + hw.overlap_compute_slowdown
    if slow != 1.0:
        extra = (slow - 1.0) * (time.forward_s + time.backward_s + time.recompute_s)
        time = time.model_copy(update={"forward_s": time.forward_s * slow, "backward_s": time.backward_s * slow,
                                       "recompute_s": time.recompute_s * slow,
                                       "step_time_s": time.step_time_s + extra})
    if knobs.zero_stage >= 2:
        parallel = ParallelConfig(world_size=knobs.data_parallel, gpus_per_node=gpus_per_node)
        n = knobs.grad_accum_steps
        comm = fsdp_communication(layout_for(graph, knobs, hw), hw, parallel, n, time.forward_s / n,
                                  (time.backward_s + time.recompute_s) / n)
        return time.model_copy(update={"communication_s": comm.exposed_s,
                                       "step_time_s": time.step_time_s + comm.exposed_s})
    comm = data_parallel_communication(graph, hw, knobs, gpus_per_node, time)
    return time.model_copy(update={"communication_s": comm.exposed_s, "step_time_s": time.step_time_s + comm.exposed_s})


def data_parallel_communication(graph: LayerGraph, hw: HardwareProfile, knobs: Knobs, gpus_per_node: int,
                                time: TimeBreakdown) -> Communication:
    """Collectives of one step over ``knobs.data_parallel`` ranks and what compute hides of them."""
    grad_bytes = [n * graph.precision.grad_dtype.n_bytes for n in graph.param_tensors.values()]
    param_bytes = graph.n_params * graph.precision.param_dtype.n_bytes
    window = (time.backward_s + time.recompute_s) / knobs.grad_accum_steps  # the last micro-batch's backward
    return ddp_communication(grad_bytes, param_bytes, knobs.zero_stage, hw,
                             ParallelConfig(world_size=knobs.data_parallel, gpus_per_node=gpus_per_node), window)


_LAYOUTS: IdentityCache[FsdpLayout] = IdentityCache()


def layout_for(graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> FsdpLayout:
    """FSDP2 units of ``graph`` (built by ``check_knobs``' compute precision) for ZeRO-2/3 knobs;
    shards keep the policy's parameter dtype (fp32 for bf16-mixed)."""
    stored = precision_spec(knobs.precision).param_dtype
    return _LAYOUTS.get((graph, hw), (knobs.data_parallel, knobs.zero_stage, stored, knobs.fsdp_grad_sync),
                        lambda: fsdp_layout(graph, knobs.data_parallel, knobs.zero_stage, stored, hw.round_alloc,
                                            knobs.fsdp_grad_sync))


def static_for(graph: LayerGraph, hw: HardwareProfile, training: TrainConfig, knobs: Knobs) -> StaticMemory:
    """Parameters, optimizer state, data batch and step temporaries of one rank.

    Several GPUs (``planner.parallel``): DDP's gradient buckets hold every gradient for the whole
    step (``gradient_as_bucket_view=True``); with ZeRO-1 a rank keeps the optimizer state (and
    step temporaries) of its own partition only, the largest partition deciding the peak. ZeRO-2/3
    (FSDP2, ``planner.fsdp``): rank 0's padded shards and their optimizer state; the walk adds the
    gathered parameters, gradients and collective buffers."""
    opt = optimizer_spec(training.optimizer, training.optimizer_impl)
    static = static_memory(
        graph,
        hw.round_alloc,
        opt.state_tensors_per_param,
        opt.step_temporaries_per_param,
        opt.device_step_scalar,
        data_sequences=knobs.micro_batch_size * knobs.grad_accum_steps,
    )
    if knobs.data_parallel == 1:
        return static
    if knobs.zero_stage >= 2:
        return fsdp_static(layout_for(graph, knobs, hw), opt.state_tensors_per_param, opt.step_temporaries_per_param,
                           opt.device_step_scalar, static.data_bytes, hw.round_alloc)
    if knobs.zero_stage == 1:
        bytes_per = graph.precision.param_dtype.n_bytes
        partitions = zero1_partition(list(graph.param_specs.values()), knobs.data_parallel)
        one = max(sum(hw.round_alloc(p.numel * bytes_per) for p in part) for part in partitions)
        scalars = hw.round_alloc(4) * max(len(part) for part in partitions) if opt.device_step_scalar else 0
        static = replace(static, optimizer_bytes=opt.state_tensors_per_param * one + scalars,
                         optimizer_step_temp_bytes=opt.step_temporaries_per_param * one)
    return replace(static, grads_resident=True)


def peak_lower_bound(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> int:
    """Bytes every placement of these knobs reaches, found without building the graph.

    At the log-softmax of the last micro-batch, whatever is checkpointed, these are live:
    parameters, optimizer state, the data batch, every gradient if an earlier micro-batch
    exists (DDP: always; FSDP2: sharded), and two fp32 (B*T, V) tensors (the logits in fp32 and
    their log-softmax).
    """
    spec = precision_spec(knobs.precision)
    opt = optimizer_spec(training.optimizer, training.optimizer_impl)
    sizes = param_tensors(model)
    params = sum(hw.round_alloc(n * spec.param_dtype.n_bytes) for n in sizes.values())
    state = params
    if knobs.data_parallel > 1 and knobs.zero_stage == 1:
        partitions = zero1_partition([ParamTensor(name=k, numel=n) for k, n in sizes.items()], knobs.data_parallel)
        state = max(sum(hw.round_alloc(p.numel * spec.param_dtype.n_bytes) for p in part) for part in partitions)
    if knobs.data_parallel > 1 and knobs.zero_stage >= 2:  # FSDP2: rank 0 holds at least 1/N of each
        shards = sum(n * spec.param_dtype.n_bytes // knobs.data_parallel for n in sizes.values())
        params = state = shards
    resident = knobs.grad_accum_steps > 1 or (knobs.data_parallel > 1 and knobs.zero_stage < 2)
    grads = sum(hw.round_alloc(n * spec.grad_dtype.n_bytes) for n in sizes.values()) if resident else 0
    if knobs.data_parallel > 1 and knobs.zero_stage >= 2 and knobs.grad_accum_steps > 1:
        grads = shards
    data = 2 * hw.round_alloc(knobs.micro_batch_size * knobs.grad_accum_steps * training.seq_len * 8)
    logits = 2 * hw.round_alloc(knobs.micro_batch_size * training.seq_len * model.vocab_size * 4)
    return params + state * opt.state_tensors_per_param + grads + data + logits


def device_bytes(peak_allocated_bytes: int, hw: HardwareProfile) -> int:
    """What the device needs for a peak: fragmentation allowance and runtime reserve added."""
    return int(peak_allocated_bytes * hw.fragmentation_factor) + hw.runtime_reserve_bytes


def estimate(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    knobs: Knobs,
    hbm_cap_bytes: int | None = None,
    gpus_per_node: int = 8,
) -> Estimate:
    """Everything about one configuration: its memory timeline, FLOPs and roofline step time."""
    spec = check_knobs(model, training, hw, knobs)
    graph = cached_graph(model, knobs.micro_batch_size, training.seq_len, spec)
    static = static_for(graph, hw, training, knobs)
    units = checkpoint_units(model.n_layers, knobs.checkpoint_blocks, knobs.checkpoint_segments)
    timeline = simulate_step(graph, static, hw.round_alloc, units, knobs.grad_accum_steps)
    _, time = rank_timing(graph, hw, training, knobs, timeline.recomputed_ops)
    time = with_communication(graph, hw, knobs, gpus_per_node, time)
    ops = op_rooflines(graph, hw)

    per_micro_flops = sum(op.cost.fwd_flops + op.cost.bwd_flops for op in graph.nodes if op.cost.has_backward)
    micro_batches = knobs.grad_accum_steps * knobs.data_parallel
    model_flops = per_micro_flops * micro_batches
    hardware_flops = model_flops + timeline.recompute_flops * micro_batches
    peak_flops = hw.peak_flops_per_s[spec.matmul_precision] * knobs.data_parallel
    cap = hbm_cap_bytes if hbm_cap_bytes is not None else hw.hbm_bytes
    peak = timeline.peak.bytes
    device = device_bytes(peak, hw)
    memory = MemoryBreakdown(
        params_bytes=static.params_bytes,
        grads_bytes=static.grads_bytes,
        optimizer_bytes=static.optimizer_bytes,
        activations_bytes=timeline.activations_bytes,
        logits_bytes=timeline.logits_bytes,
        data_bytes=static.data_bytes,
        peak_allocated_bytes=peak,
        device_bytes=device,
        hbm_cap_bytes=cap,
        fits=device <= cap,
        peak_phase=timeline.peak.phase,
        peak_op=timeline.peak.op,
        peak_micro_batch=timeline.peak.micro_batch,
        at_peak=timeline.peak.breakdown,
    )
    compute_s = sum(op.fwd_time_s + op.bwd_time_s for op in ops if op.bound is Bound.COMPUTE)
    memory_s = sum(op.fwd_time_s + op.bwd_time_s for op in ops if op.bound is Bound.MEMORY) + time.optimizer_s
    return Estimate(
        hardware=hw.name,
        n_params=graph.n_params,
        step_time_s=time.step_time_s,
        tokens_per_s=training.tokens_per_step / time.step_time_s,
        mfu=model_flops / (time.step_time_s * peak_flops),
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware_flops,
        time=time,
        memory=memory,
        ops=ops,
        op_groups=_GROUPS.get((graph, hw), (knobs.grad_accum_steps,), lambda: group_ops(ops, knobs.grad_accum_steps)),
        limiting_bound=Bound.COMPUTE if compute_s >= memory_s else Bound.MEMORY,
    )
