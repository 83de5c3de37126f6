"""ZeRO-2/3 as FSDP2 runs them (``fully_shard`` per block and on the root): the strategy over
``planner.parallel.fsdp_units``'s layout, static memory, walk hooks and collectives.

``reshard_after_forward`` False (sharding ``gradients``, ZeRO-2) keeps a unit's gathered
parameters from its forward to its backward; True (``full``, ZeRO-3) frees them after the forward
and gathers them again for the backward. Under a pipeline both run as torchtitan runs them there
(``reshard_after_forward=False``, ``planner.parallel.fsdp_pipeline``): each stage gathered once
per step and reduce-scattered once, after its last backward. bf16-mixed runs as
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the step computes in bf16 on
gathered bf16 parameters, without autocast (the bf16-true graph), while shards, gradients and
AdamW state stay fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hardware.profile import HardwareProfile
from planner.cache import IdentityCache
from planner.graph.layer_graph import LayerGraph
from planner.memory.engine import StaticMemory
from planner.memory.step import buffer_bytes
from planner.ops.base import ParamTensor
from planner.parallel.base import SingleDevice, refuse
from planner.parallel.collectives import ParallelConfig
from planner.parallel.fsdp_engine import fsdp_static
from planner.parallel.fsdp_pipeline import PipelinedFsdpEngine, check_pipelined, gathers_up_front
from planner.parallel.fsdp_units import (
    FSDP_PRECISIONS,
    FsdpLayout,
    fsdp_bytes_moved,
    fsdp_collectives,
    fsdp_layout,
    shard_fraction,
)
from planner.plan.knobs import GradSync, Knobs
from planner.plan.optimizer import OptimizerSpec
from planner.plan.parallel_dims import Group
from planner.precision import PrecisionPolicy, PrecisionSpec, precision_spec
from planner.timing.step_time import NO_COLLECTIVES, Collectives

_LAYOUTS: IdentityCache[FsdpLayout] = IdentityCache()
_COLLECTIVES: IdentityCache[Collectives] = IdentityCache()


class Fsdp2(SingleDevice):
    """FSDP2 over the data-parallel shard dimension (and the context-parallel ranks with it)."""

    allows_segments = False  # a segment's recompute would re-gather every block of it: not modelled
    communicates = True
    runtime = "FSDP2"
    shards_params = True
    shards_state = True

    def describe(self, knobs: Knobs) -> str:
        if knobs.parallel.pp > 1:
            return ("FSDP2 under a pipeline, as torchtitan runs it (reshard_after_forward=False): each stage's params "
                    "gathered at its first forward and kept all step, its gradients held unsharded until one "
                    "reduce-scatter after its last backward")
        kept = ("each block's params gathered for its forward and again for its backward" if self.reshard_after_forward
                else "each block's params gathered from its forward to its backward")
        sync = ("; gradients reduce-scattered after the last micro-batch only (set_requires_gradient_sync), every "
                "unsharded gradient held until then" if knobs.fsdp_grad_sync is GradSync.LAST else "")
        dims = knobs.parallel
        hsdp = (f"; HSDP: sharded over {dims.dp_shard} ranks, each sharded gradient all-reduced across "
                f"{dims.dp_replicate} replicas" if dims.hsdp else "")
        return f"FSDP2 (everything sharded; {kept}){sync}{hsdp}"

    def gradients(self, knobs: Knobs) -> str:
        if knobs.parallel.pp > 1:
            return ("sharded, reduce-scattered once per step after the stage's last backward; the unsharded copies "
                    "held until then are in the peak")
        if knobs.fsdp_grad_sync is GradSync.LAST:
            return "sharded, reduce-scattered once per step; unsharded copies held between micro-batches are in the peak"
        return "sharded, reduce-scattered after every micro-batch"

    def __init__(self, reshard_after_forward: bool) -> None:
        self.reshard_after_forward = reshard_after_forward
        self.stage = 3 if reshard_after_forward else 2
        self.label = f"ZeRO-{self.stage}: FSDP2"

    def check(self, knobs: Knobs) -> None:
        if not self.runs(knobs.precision):
            allowed = ", ".join(p.value for p in FSDP_PRECISIONS)
            refuse("precision", f"{knobs.precision.value} with ZeRO-{self.stage} (FSDP2) is not modelled (FSDP2 "
                   f"needs a sharded grad scaler for fp16 and Float8 training for fp8); use {allowed}, or ZeRO-0/1")
        if knobs.parallel.pp > 1:
            check_pipelined(knobs, self.stage)
        if knobs.checkpoint_segments:
            refuse("checkpoint_segments", "segments of several blocks under FSDP2 re-gather every block of a segment "
                   "during its recompute, which is not modelled; checkpoint blocks one by one (checkpoint_blocks)")

    def runs(self, precision: PrecisionPolicy) -> bool:
        return precision in FSDP_PRECISIONS

    def compute_spec(self, precision: PrecisionPolicy) -> PrecisionSpec:
        if precision is PrecisionPolicy.BF16_MIXED:
            return precision_spec(PrecisionPolicy.BF16_TRUE)
        return precision_spec(precision)

    def layout(self, graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> FsdpLayout:
        """FSDP2 units of ``graph`` (built in ``compute_spec``'s precision); shards keep the policy's
        parameter dtype (fp32 for bf16-mixed)."""
        stored = precision_spec(knobs.precision).param_dtype
        ranks, experts = knobs.parallel.fsdp_ranks, knobs.parallel.expert_shard_ranks
        replicas = knobs.parallel.dp_replicate  # HSDP: > 1
        return _LAYOUTS.get((graph, hw), (ranks, self.stage, stored, knobs.fsdp_grad_sync, experts, replicas),
                            lambda: fsdp_layout(graph, ranks, self.stage, stored, hw.round_alloc, knobs.fsdp_grad_sync,
                                                experts, replicas))

    def static(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs, opt: OptimizerSpec,
               base: StaticMemory) -> StaticMemory:
        layout = self.layout(graph, knobs, hw)
        static = fsdp_static(layout, opt.state_tensors_per_param, opt.step_temporaries_per_param,
                             opt.device_step_scalar, base.data_bytes, hw.round_alloc,
                             buffers=buffer_bytes(graph, hw.round_alloc))
        if knobs.parallel.pp == 1:
            return static
        engine = PipelinedFsdpEngine(layout=layout, layouts=(layout,), up_front=gathers_up_front(knobs.pp_schedule))
        return replace(static, engine=engine)

    def optimizer_shard_fraction(self, graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> float:
        return shard_fraction(self.layout(graph, knobs, hw), graph.n_params)

    def _group(self, knobs: Knobs, hw: HardwareProfile) -> ParallelConfig:
        return ParallelConfig(world_size=knobs.parallel.fsdp_ranks,
                              gpus_per_node=knobs.parallel.ranks_per_node(Group.FSDP, hw.gpus_per_node))

    def collectives(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> Collectives:
        if knobs.parallel.pp > 1:  # none per micro-batch: once per step (``once_per_step``)
            return NO_COLLECTIVES
        return self._collectives(graph, hw, knobs, pipelined=False)

    def once_per_step(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> Collectives:
        if knobs.parallel.pp == 1:
            return NO_COLLECTIVES
        return self._collectives(graph, hw, knobs, pipelined=True)

    def _replicas(self, knobs: Knobs, hw: HardwareProfile) -> ParallelConfig | None:
        """HSDP: the ranks one all-reduce spans (one per replica; across nodes once a replica's
        shard group fills a node)."""
        dims = knobs.parallel
        if not dims.hsdp:
            return None
        return ParallelConfig(world_size=dims.dp_replicate,
                              gpus_per_node=dims.ranks_per_node(Group.REPLICATE, hw.gpus_per_node))

    def _collectives(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs, pipelined: bool) -> Collectives:
        layout = self.layout(graph, knobs, hw)
        group, replicas = self._group(knobs, hw), self._replicas(knobs, hw)
        return _COLLECTIVES.get((layout, hw), (group, pipelined, replicas),
                                lambda: fsdp_collectives(layout, hw, group, pipelined, replicas))

    def bytes_moved(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> float:
        return fsdp_bytes_moved(self.layout(graph, knobs, hw), self._group(knobs, hw),
                                knobs.grad_accum_steps, pipelined=knobs.parallel.pp > 1)

    def model_state_lower_bound(self, tensors: Mapping[str, ParamTensor], spec: PrecisionSpec, knobs: Knobs,
                                hw: HardwareProfile, state_tensors_per_param: int) -> int:
        """Rank 0 holds at least 1/N of each tensor as parameters, each state tensor and (after the
        first micro-batch) the sharded gradient (N: the FSDP2 ranks, or ``expert_shard_ranks`` for
        this rank's experts under expert parallelism). ZeRO-2 also holds, at the loss of every
        micro-batch, each unit's unsharded parameters in the compute dtype (``unsharded_bytes`` of
        ``planner.parallel.fsdp_units``, at least the tensor's elements x its bytes): every block
        keeps its own from its forward to its backward, and the root stays gathered. Under a
        pipeline (``planner.parallel.fsdp_pipeline``) so do both ZeRO stages, and after the first
        micro-batch every unit's unsharded gradient accumulates too (``tensors``: the whole model's;
        the caller divides by the pipeline ranks)."""
        dims = knobs.parallel
        shards = sum(p.numel * spec.param_dtype.n_bytes // (dims.expert_shard_ranks if p.expert_parallel
                                                            else dims.fsdp_ranks) for p in tensors.values())
        state = shards * (1 + state_tensors_per_param) + (shards if knobs.grad_accum_steps > 1 else 0)
        if self.reshard_after_forward and dims.pp == 1:
            return state
        compute = self.compute_spec(knobs.precision).param_dtype.n_bytes
        gathered = sum(p.numel * compute for p in tensors.values())
        if dims.pp > 1 and knobs.grad_accum_steps > 1:
            gathered += sum(p.numel * spec.grad_dtype.n_bytes for p in tensors.values())
        return state + gathered
