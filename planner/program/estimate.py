"""``estimate``: the exact account of one configuration — FLOPs, memory timeline, step time.

FLOPs convention (README): ``model_flops_per_step`` counts every matmul and attention product
as ``torch.utils.flop_counter.FlopCounterMode`` does (2 per multiply-add, the full T x T
scores, backward = 2 x forward) and excludes recomputation; ``hardware_flops_per_step`` adds
the forward FLOPs that activation checkpointing runs again. MFU = model FLOPs / (step time x
dense peak of the plan's matmul precision x GPUs) (PaLM, Chowdhery et al. 2022, appendix B).
"""

from __future__ import annotations

import math
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

from hardware.profile import HardwareProfile
from hardware.roofline import Bound
from hardware.stack import on_stack
from planner.cache import IdentityCache
from planner.errors import ConfigError, UnsupportedPrecisionError
from planner.graph.description import ModelDesc
from planner.graph.layer_graph import LayerGraph, build_graph
from planner.graph.stages import StageSpan
from planner.memory.step import Category, Phase, StaticMemory, checkpoint_units, recomputed_ops, static_memory
from planner.model.config import AttentionImpl, ModelConfig, TrainConfig
from planner.parallel.context import local_seq_len, shard_context_parallel
from planner.parallel.expert import shard_experts
from planner.parallel.fsdp_units import FsdpLayout
from planner.parallel.strategies import Fsdp2, strategy_for
from planner.parallel.tensor import rank_description
from planner.plan.checkpointing import CONTEXT_PARALLEL_REFUSAL, modelled_with_context_parallelism
from planner.plan.knobs import Knobs
from planner.plan.layouts import check_layout
from planner.plan.optimizer import optimizer_spec
from planner.plan.parallel_dims import Group
from planner.plan.pipeline_plan import check_modelled
from planner.plan.schedule import Schedule
from planner.precision import PrecisionSpec, precision_spec
from planner.program.pipeline_program import (
    StageEstimate,
    pipeline_ranks,
    pipelined_time,
    stage_estimates,
)
from planner.program.step_program import RankProgram, StepProgram, device_bytes
from planner.timing.op_times import (
    OpGroup,
    OpRoofline,
    OpTimes,
    TimeBreakdown,
    group_ops,
    op_rooflines_of,
    op_times,
    optimizer_time_s,
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
    # pipeline parallelism: every stage's blocks, memory and time (``memory`` is the busiest's)
    stages: tuple[StageEstimate, ...] = ()

    @property
    def fits(self) -> bool:
        return self.memory.fits


def compute_spec(knobs: Knobs) -> PrecisionSpec:
    """The precision the step computes in: the policy's, unless the data-parallel strategy runs it
    otherwise (FSDP2 runs bf16-mixed as the bf16-true graph on fp32 shards)."""
    return strategy_for(knobs.parallel).compute_spec(knobs.precision)


def check_knobs(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> PrecisionSpec:
    """Reject knobs that cannot describe this workload on this device; return the precision the
    step computes in (``compute_spec``: what the graph is built with)."""
    if knobs.sequences_per_step != training.global_batch_size:
        raise ConfigError(
            f"knobs: micro_batch_size {knobs.micro_batch_size} x grad_accum_steps {knobs.grad_accum_steps} x "
            f"data_parallel {knobs.data_parallel} = {knobs.sequences_per_step} sequences, but "
            f"training.global_batch_size is {training.global_batch_size}; choose a micro-batch that divides it"
        )
    strategy_for(knobs.parallel).check(knobs)
    policies = {knobs.checkpoint_policy, *knobs.policy_overrides.values()}
    if knobs.checkpoint_blocks and not all(modelled_with_context_parallelism(p, knobs.parallel.cp) for p in policies):
        raise ConfigError(CONTEXT_PARALLEL_REFUSAL)
    check_layout(model, training.seq_len, knobs.parallel)
    if knobs.parallel.pp > 1:
        check_modelled(knobs.pp_schedule, knobs.parallel.pp, knobs.grad_accum_steps, model.n_layers, knobs.pp_layers,
                       knobs.pp_virtual, checkpointing=bool(knobs.checkpointed))
    outside = [b for b in knobs.checkpointed if b >= model.n_layers]
    if outside:
        raise ConfigError(
            f"knobs.checkpoint_blocks: block {outside[0]} does not exist; the model has blocks 0..{model.n_layers - 1}"
        )
    kernel = model.attention_kernel
    if model.attention is AttentionImpl.FLASH and kernel is not None and kernel not in hw.attention_kernels:
        runs = ", ".join(k.value for k in hw.attention_kernels)
        raise ConfigError(f"attention_kernel: {kernel.value} does not run on {hw.name} (it runs {runs}); name one of "
                          "those in the model file, or leave attention_kernel out for the one PyTorch picks there")
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
def cached_graph(model: ModelConfig, batch: int, seq_len: int, spec: PrecisionSpec, tp: int = 1, sp: bool = False,
                 tp_ranks_per_node: int = 1, cp: int = 1, cp_ranks_per_node: int = 1, ep: int = 1,
                 ep_ranks_per_node: int = 1) -> LayerGraph:
    """One rank's graph: the model's description as tensor and context parallelism shard it
    (``planner.parallel.tensor``, ``planner.parallel.context``; ``seq_len`` is the rank's
    share of each sequence), each op priced by its formula."""
    desc = shard_context_parallel(rank_description(model, tp, sp, tp_ranks_per_node), cp, cp_ranks_per_node)
    desc = shard_experts(desc, ep, ep_ranks_per_node)
    return build_graph(model, batch, seq_len, spec, desc)


def rank_graph(model: ModelConfig, training: TrainConfig, knobs: Knobs, spec: PrecisionSpec,
               hw: HardwareProfile) -> LayerGraph:
    """The graph of one rank of ``knobs``' layout (its micro-batch, its tokens of each sequence,
    its shard of the model) on ``hw``'s nodes (which groups' collectives cross them)."""
    dims, per_node = knobs.parallel, hw.gpus_per_node
    return cached_graph(model, knobs.micro_batch_size, local_seq_len(training.seq_len, dims), spec, dims.tp, dims.sp,
                        dims.ranks_per_node(Group.TP, per_node), dims.cp, dims.ranks_per_node(Group.CP, per_node),
                        dims.ep, dims.ranks_per_node(Group.EP, per_node))


def op_rooflines(graph: LayerGraph, hw: HardwareProfile) -> tuple[OpRoofline, ...]:
    """Every op's roofline for one micro-batch (cached per graph and device)."""
    precision = graph.precision.matmul_precision
    return _ROOFLINES.get((graph, hw), (), lambda: op_rooflines_of(graph.nodes, precision, hw))


def times_of(graph: LayerGraph, hw: HardwareProfile) -> OpTimes:
    """Per-op times for one micro-batch (cached per graph and device)."""
    return _TIMES.get((graph, hw), (), lambda: op_times(graph.nodes, graph.precision.matmul_precision, hw))


def optimizer_shard_fraction(graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> float:
    """The share of the parameters this rank's optimizer updates (ZeRO-1: its largest partition;
    FSDP2: its padded shards)."""
    return strategy_for(knobs.parallel).optimizer_shard_fraction(graph, knobs, hw)


def step_program(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> StepProgram:
    """The step program of ``knobs`` (checked): every rank's graph, static memory and engine,
    schedule, collectives and op times, and the plan's checkpoint units; under pipeline
    parallelism one rank program per stage (``planner.program.pipeline_program``). Timed on ``hw``
    as ``training.stack`` runs it (``hardware.stack.on_stack``)."""
    hw = on_stack(hw, training.stack)
    spec = check_knobs(model, training, hw, knobs)
    graph = rank_graph(model, training, knobs, spec, hw)
    units = checkpoint_units(model.n_layers, knobs.checkpoint_blocks, knobs.checkpoint_segments,
                             knobs.checkpoint_policy, knobs.save_list, knobs.policy_overrides)
    dims = knobs.parallel
    if dims.pp == 1:
        return StepProgram(ranks=(_rank_program(graph, knobs.schedule, training, hw, knobs, dims.world_size),),
                           units=units, hw=hw)
    ranks = pipeline_ranks(graph, knobs, hw, lambda g, schedule, span: _rank_program(
        g, schedule, training, hw, knobs, dims.world_size // dims.pp, span))
    return StepProgram(ranks=ranks, units=units, hw=hw)


def _rank_program(graph: LayerGraph, schedule: Schedule, training: TrainConfig, hw: HardwareProfile, knobs: Knobs,
                  ranks: int, stage: StageSpan | None = None) -> RankProgram:
    opt = optimizer_spec(training.optimizer, training.optimizer_impl)
    return RankProgram(
        graph=graph, static=static_for(graph, hw, training, knobs), schedule=schedule,
        collectives=strategy_for(knobs.parallel).collectives(graph, hw, knobs),
        times=times_of(graph, hw),
        optimizer_s=optimizer_time_s(graph, opt, hw, optimizer_shard_fraction(graph, knobs, hw),
                                     precision_spec(knobs.precision).param_dtype),
        ranks=ranks, stage=stage)


def layout_for(graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> FsdpLayout:
    """FSDP2 units of ``graph`` for ZeRO-2/3 knobs (``Fsdp2.layout``)."""
    strategy = strategy_for(knobs.parallel)
    if not isinstance(strategy, Fsdp2):
        raise ValueError(f"layout_for: {strategy.label} has no FSDP2 layout")
    return strategy.layout(graph, knobs, hw)


def static_for(graph: LayerGraph, hw: HardwareProfile, training: TrainConfig, knobs: Knobs) -> StaticMemory:
    """Parameters, optimizer state, data batch and step temporaries of one rank: the whole model's
    (``static_memory``) as the data-parallel strategy holds it (``planner.parallel.strategies``)."""
    opt = optimizer_spec(training.optimizer, training.optimizer_impl)
    static = static_memory(
        graph,
        hw.round_alloc,
        opt.state_tensors_per_param,
        opt.step_temporaries_per_param,
        opt.device_step_scalar,
        data_sequences=knobs.micro_batch_size * knobs.grad_accum_steps,
        data_seq_len=training.seq_len,  # sharded in place under context parallelism: the storage keeps T
    )
    return strategy_for(knobs.parallel).static(graph, hw, knobs, opt, static)


_EXPERT_SHARDS: IdentityCache[ModelDesc] = IdentityCache()
_STATE_BOUNDS: IdentityCache[int] = IdentityCache(maxsize=4096)


def peak_lower_bound(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> int:
    """Bytes every placement of these knobs reaches, found without building the graph.

    At the log-softmax of the last micro-batch, whatever is checkpointed, these are live:
    parameters, optimizer state, the data batch, every gradient if an earlier micro-batch
    exists (DDP: always; FSDP2: sharded), ZeRO-2's gathered parameters (kept from each unit's
    forward to its backward), and two fp32 (B*T, V) tensors (the logits in fp32 and their
    log-softmax). The model state is the strategy's ``model_state_lower_bound`` over the rank's
    parameters (its tensor- and expert-parallel shards). Under pipeline parallelism the ranks
    split the model: the busiest holds at least the average share of that state.
    """
    spec = precision_spec(knobs.precision)
    opt = optimizer_spec(training.optimizer, training.optimizer_impl)
    dims = knobs.parallel
    desc = _EXPERT_SHARDS.get((rank_description(model, dims.tp, dims.sp, 1),), (dims.ep,),
                              lambda: shard_experts(rank_description(model, dims.tp, dims.sp, 1), dims.ep, 1))
    key = (knobs.precision, dims, knobs.grad_accum_steps > 1, knobs.fsdp_grad_sync, opt.state_tensors_per_param)
    model_state = _STATE_BOUNDS.get((desc, hw), key, lambda: strategy_for(dims).model_state_lower_bound(
        desc.params, spec, knobs, hw, opt.state_tensors_per_param))  # sizes only
    data = 2 * hw.round_alloc(knobs.micro_batch_size * knobs.grad_accum_steps * training.seq_len * 8)
    vocab = math.ceil(model.vocab_size / dims.tp)  # loss_parallel: this rank's share of the vocabulary
    tokens = knobs.micro_batch_size * local_seq_len(training.seq_len, dims)
    logits = 2 * hw.round_alloc(tokens * vocab * 4)
    if dims.pp > 1:  # the busiest rank holds at least the ranks' average share of the model state
        return model_state // dims.pp
    return model_state + data + logits


def step_time_s(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> float:
    """``estimate(...).step_time_s`` without the memory walk: the ops checkpointing runs again
    follow from the placement alone (``recomputed_ops``), and time needs nothing else of the walk."""
    program = step_program(model, training, hw, knobs)
    if knobs.parallel.pp > 1:
        # each rank's recompute over every stage it holds (a looped schedule's ``others`` too)
        recomputed = tuple(frozenset().union(*(recomputed_ops(g, program.units) for g in r.graphs))
                           for r in program.ranks)
        return pipelined_time(program, knobs, recomputed, whole=False).step_time_s
    return program.time(recomputed_ops(program.busiest.graph, program.units)).step_time_s


def estimate(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    knobs: Knobs,
    hbm_cap_bytes: int | None = None,
) -> Estimate:
    """Everything about one configuration: its memory timeline, FLOPs and roofline step time
    (``hw`` is the device and its node: ``HardwareProfile.gpus_per_node``; timed as
    ``training.stack`` runs it)."""
    hw = on_stack(hw, training.stack)
    program = step_program(model, training, hw, knobs)
    walks = tuple(program.walk(rank=r) for r in program.ranks)
    busiest = max(range(len(walks)), key=lambda i: walks[i].peak.bytes)  # ties: the first stage
    rank, timeline = program.ranks[busiest], walks[busiest]
    graph, static = rank.graph, rank.static
    spec = graph.precision
    recomputed = tuple(w.recomputed_ops for w in walks)
    pipelined = knobs.parallel.pp > 1
    time = pipelined_time(program, knobs, recomputed) if pipelined else program.time(timeline.recomputed_ops)
    ops = op_rooflines(graph, hw)
    model_flops = program.model_flops_per_step()
    hardware_flops = program.hardware_flops_per_step({i: w.recompute_flops for i, w in enumerate(walks)})
    peak_flops = hw.peak_flops_per_s[spec.matmul_precision] * program.world_size
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
        stages=stage_estimates(program, knobs, walks, time.timeline) if pipelined and time.timeline else (),
    )
