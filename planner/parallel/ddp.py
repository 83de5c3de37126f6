"""DDP and ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``), as PyTorch runs them (planner.parallel.collectives).

DDP (``gradient_as_bucket_view=True``): every gradient lives in DDP's buckets for the whole
step; gradients are all-reduced once per step, bucket by bucket during the last micro-batch's
backward (``no_sync`` on the others). ZeRO-1 keeps the optimizer state (and step temporaries)
of the rank's own partition (torch's greedy partition, the largest deciding the peak) and
broadcasts every rank's updated partition after the step, fully exposed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hardware.profile import HardwareProfile
from planner.graph.layer_graph import LayerGraph
from planner.memory.engine import ResidentGradients, StaticMemory
from planner.ops.base import ParamTensor
from planner.parallel.base import SingleDevice
from planner.parallel.collectives import ParallelConfig, ddp_bytes_moved, ddp_collectives, zero1_partition
from planner.plan.knobs import Knobs
from planner.plan.optimizer import OptimizerSpec
from planner.plan.parallel_dims import Group
from planner.precision import PrecisionSpec
from planner.timing.step_time import Collectives


def _synced_bytes(graph: LayerGraph) -> tuple[list[int], int]:
    """Each gradient's bytes (what the buckets all-reduce) and the parameters' (what ZeRO-1 broadcasts)."""
    return ([n * graph.precision.grad_dtype.n_bytes for n in graph.grad_tensors.values()],
            graph.n_params * graph.precision.param_dtype.n_bytes)


class Ddp(SingleDevice):
    """DDP over the data-parallel ranks: replicated model, all-reduced gradients."""

    label = "DDP"
    runtime = "DDP"
    communicates = True
    shards_optimizer = False

    def describe(self, knobs: Knobs) -> str:
        return "DDP (gradient buckets, all-reduced once per step)"

    def gradients(self, knobs: Knobs) -> str:
        return "DDP's buckets, the whole step"

    def static(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs, opt: OptimizerSpec,
               base: StaticMemory) -> StaticMemory:
        return replace(base, engine=ResidentGradients())

    def _group(self, knobs: Knobs, hw: HardwareProfile) -> ParallelConfig:
        return ParallelConfig(world_size=knobs.data_parallel,
                              gpus_per_node=knobs.parallel.ranks_per_node(Group.DP, hw.gpus_per_node))

    def collectives(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> Collectives:
        return ddp_collectives(*_synced_bytes(graph), self.shards_optimizer, hw, self._group(knobs, hw))

    def bytes_moved(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> float:
        return ddp_bytes_moved(*_synced_bytes(graph), self.shards_optimizer, self._group(knobs, hw))

    def _grads_at_loss(self, knobs: Knobs) -> bool:
        return True  # DDP's buckets exist for the whole step


class ZeroOne(Ddp):
    """ZeRO-1: DDP with the optimizer state partitioned over the ranks."""

    label = "ZeRO-1"
    runtime = "DDP + ZeroRedundancyOptimizer"
    shards_optimizer = True
    shards_state = True

    def describe(self, knobs: Knobs) -> str:
        return "DDP + ZeroRedundancyOptimizer (optimizer state sharded, updated partitions broadcast)"

    def static(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs, opt: OptimizerSpec,
               base: StaticMemory) -> StaticMemory:
        bytes_per = graph.precision.param_dtype.n_bytes
        partitions = zero1_partition(list(graph.param_specs.values()), knobs.data_parallel)
        one = max(sum(hw.round_alloc(p.numel * bytes_per) for p in part) for part in partitions)
        scalars = hw.round_alloc(4) * max(len(part) for part in partitions) if opt.device_step_scalar else 0
        return replace(base, optimizer_bytes=opt.state_tensors_per_param * one + scalars,
                       optimizer_step_temp_bytes=opt.step_temporaries_per_param * one,
                       engine=ResidentGradients())

    def optimizer_shard_fraction(self, graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> float:
        partitions = zero1_partition(list(graph.param_specs.values()), knobs.data_parallel)
        return max(sum(p.numel for p in part) for part in partitions) / graph.n_params

    def model_state_lower_bound(self, tensors: Mapping[str, ParamTensor], spec: PrecisionSpec, knobs: Knobs,
                                hw: HardwareProfile, state_tensors_per_param: int) -> int:
        params = sum(hw.round_alloc(p.numel * spec.param_dtype.n_bytes) for p in tensors.values())
        partitions = zero1_partition(list(tensors.values()), knobs.data_parallel)
        state = max(sum(hw.round_alloc(p.numel * spec.param_dtype.n_bytes) for p in part) for part in partitions)
        grads = sum(hw.round_alloc(p.grad_elements * spec.grad_dtype.n_bytes) for p in tensors.values())
        return params + state * state_tensors_per_param + grads
