"""Data parallelism over N GPUs with ZeRO stages, as PyTorch runs them.

| stage | PyTorch | each rank holds |
|---|---|---|
| 0 | DDP (``gradient_as_bucket_view=True``) | params, grads (DDP's buckets), optimizer state |
| 1 | DDP + ``ZeroRedundancyOptimizer`` | params, grads; optimizer state of its parameter partition |
| 2 | FSDP2 ``fully_shard(reshard_after_forward=False)`` | 1/N of params, grads, state; unsharded params from a unit's forward to its backward |
| 3 | FSDP2 ``fully_shard(reshard_after_forward=True)`` | 1/N of everything; a unit's params gathered for its forward and again for its backward |

Model-state bytes per rank follow Rajbhandari et al. 2019 (ZeRO, Sec. 5 and Fig. 1) with P, G, O
the bytes per parameter of parameters, gradients and optimizer state:
stage 0 (P+G+O)Ψ, stage 1 (P+G)Ψ + OΨ/N, stage 2 PΨ + (G+O)Ψ/N, stage 3 (P+G+O)Ψ/N. PyTorch's
granularity makes them exact only up to how tensors split: ZeroRedundancyOptimizer assigns whole
tensors to ranks (greedily, largest first), FSDP2 chunks every tensor's first dimension into N
pieces of ceil(rows/N) rows (the last ranks padded).

Communication follows NCCL's own model (``hardware.collectives``): a ring all-reduce moves
2(N-1)/N of the bytes through each GPU's link, a reduce-scatter or an all-gather (N-1)/N (an
all-reduce across nodes may take NCCL's tree instead), plus latency per ring step; across nodes
a ring runs over every NIC of a node at once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from hardware.collectives import Collective, collective_time_s
from hardware.profile import HardwareProfile
from planner.ops.base import ParamTensor
from planner.plan.layouts import MODELLED_STAGES as MODELLED_STAGES  # re-exports: which layouts exist is
from planner.plan.layouts import zero_stages as zero_stages  # planner.plan.layouts' to say
from planner.timing.step_time import Collectives


class ParallelConfig(BaseModel):
    """Where the data-parallel ranks live."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    world_size: int = Field(default=1, gt=0, description="GPUs (data-parallel ranks)")
    gpus_per_node: int = Field(default=8, gt=0, description="GPUs that share a node's fast interconnect")

    @property
    def nodes(self) -> int:
        return math.ceil(self.world_size / self.gpus_per_node)


def model_state_bytes(n_params: float, world_size: int, stage: int, param_bytes: float, grad_bytes: float,
                      optimizer_bytes: float) -> float:
    """ZeRO's per-rank model-state bytes (Rajbhandari et al. 2019, Fig. 1): the closed form."""
    p, g, o, n = param_bytes * n_params, grad_bytes * n_params, optimizer_bytes * n_params, world_size
    if stage == 0:
        return p + g + o
    if stage == 1:
        return p + g + o / n
    if stage == 2:
        return p + (g + o) / n
    return (p + g + o) / n


def fsdp_shard_numel(param: ParamTensor, world_size: int) -> int:
    """Elements of one rank's (padded) FSDP2 shard: ceil(rows / N) rows of the tensor."""
    rows = param.dim0
    return math.ceil(rows / world_size) * (param.numel // rows)


def zero1_partition(params: Sequence[ParamTensor], world_size: int) -> list[list[ParamTensor]]:
    """ZeroRedundancyOptimizer's partition: parameters sorted by size, largest first, each to the
    rank with the fewest elements so far (torch/distributed/optim/zero_redundancy_optimizer.py,
    ``_partition_parameters``)."""
    ranks: list[list[ParamTensor]] = [[] for _ in range(world_size)]
    lightest = [(0, rank) for rank in range(world_size)]  # a heap of (elements so far, rank): ties to the lowest rank
    for param in sorted(params, key=lambda p: p.numel, reverse=True):
        size, rank = heapq.heappop(lightest)
        ranks[rank].append(param)
        heapq.heappush(lightest, (size + param.numel, rank))
    return ranks


def ring_time_s(n_bytes: float, kind: Collective, hw: HardwareProfile, parallel: ParallelConfig,
                n_collectives: int = 1) -> float:
    """Seconds of ``n_collectives`` NCCL collectives that together move ``n_bytes`` (full tensors,
    not shards), as NCCL runs them (``hardware.collectives``: ring or tree, every NIC of a node,
    latency per step)."""
    if parallel.world_size <= 1 or n_bytes <= 0:
        return 0.0
    count = max(1, n_collectives)
    one, _ = collective_time_s(n_bytes / count, Collective(kind), hw, parallel.world_size, parallel.gpus_per_node)
    return count * one


def ddp_buckets(grad_bytes: Iterable[int], bucket_cap_bytes: int = 25 * 2**20) -> int:
    """How many all-reduce buckets DDP forms (``bucket_cap_mb=25``; the first bucket is 1 MB)."""
    buckets, current, cap = 0, 0, 2**20
    for size in grad_bytes:
        current += size
        if current >= cap:
            buckets, current, cap = buckets + 1, 0, bucket_cap_bytes
    return buckets + (1 if current else 0)


def ddp_collectives(grad_bytes: Sequence[int], param_bytes: int, broadcast_partitions: bool, hw: HardwareProfile,
                    parallel: ParallelConfig) -> Collectives:
    """DDP all-reduces the gradients once per step, bucket by bucket while the last micro-batch's
    backward runs (``no_sync`` on the others): every bucket but the last beside that backward, the
    last one after it. ZeRO-1 then broadcasts every rank's updated partition, after the optimizer
    step (``planner.timing.step_time`` places them)."""
    buckets = max(1, ddp_buckets(grad_bytes))
    all_reduce = ring_time_s(float(sum(grad_bytes)), Collective.ALL_REDUCE, hw, parallel, buckets)
    last = all_reduce / buckets
    broadcast = (ring_time_s(param_bytes, Collective.ALL_GATHER, hw, parallel, parallel.world_size)
                 if broadcast_partitions else 0.0)
    return Collectives(during_sync_backward_s=all_reduce - last, after_sync_backward_s=last,
                       after_optimizer_s=broadcast)


def ddp_bytes_moved(grad_bytes: Sequence[int], param_bytes: int, broadcast_partitions: bool,
                    parallel: ParallelConfig) -> float:
    """Bytes one rank sends in a step: the ring all-reduce's 2(N-1)/N of the gradients, and
    ZeRO-1's broadcast of the updated partitions, (N-1)/N of the parameters."""
    factor = (parallel.world_size - 1) / parallel.world_size
    return 2.0 * factor * float(sum(grad_bytes)) + (factor * param_bytes if broadcast_partitions else 0.0)


