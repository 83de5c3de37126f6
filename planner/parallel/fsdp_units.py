"""ZeRO-2/3 as FSDP2 runs them: the units, their buffers' bytes and collectives (``planner.parallel.fsdp_engine``
adds those buffers to the walk).

The rules are ``docs/distributed_memory.md`` section 4 (PyTorch 2.13's
``torch/distributed/fsdp/_fully_shard``), each measured there to the byte with the live-storage
tracker on a fake process group. The setup they describe, and ``validate`` applies:
``fully_shard`` on every block, then on the model (the *root*: embedding, final norm, head);
``reshard_after_forward`` = (stage == 3) for both; for bf16-mixed a
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` instead of autocast, so the
forward runs in bf16 on gathered bf16 parameters (the walk is the bf16-true graph's) while the
sharded parameters, gradients and AdamW state stay fp32; gradients reduce-scattered after every
micro-batch; ``zero_grad(set_to_none=True)``.

Per unit U (its parameters p: ``n_p`` elements, ``d0_p`` rows), N ranks, ``o`` bytes of the
stored (sharded) dtype, ``c`` of the compute dtype, r() the allocator's rounding:

- padded shard ``s_p = ceil(d0_p / N) * n_p / d0_p`` elements on every rank; rank 0 holds the
  most (a full ``ceil(d0/N)`` rows), so its AdamW state is ``r(s_p o)`` per state tensor;
- all-gather input ``AGin = r(S_U c)`` (only when c != o: the cast of the shards), output
  ``AG = r(N S_U c)``, unsharded parameters ``Ug = sum_p r(N s_p c)``, with S_U = sum_p s_p;
- reduce-scatter input ``RSin = r(N S_U o)``, output ``RSo = Gs = r(S_U o)`` (the sharded
  gradient, kept from the first micro-batch, later ones added into it and freed);
- the unit's last parameter's unsharded gradient outlives the others by one call.

Forward: the root is gathered first and stays gathered; each block's all-gather and copy-out
happen while the previous unit's all-gather output is still held; stage 3 frees a block's
parameters after its forward, stage 2 keeps them until its backward. Backward (stage 3): the
root is gathered again at the loss gradient and the last block prefetched; each block copies out
its prefetched gather and prefetches the one before it. Post-backward of a unit (its input's
gradient ready): reshard, drop the previous unit's held reduce-scatter input, allocate its own
(every unsharded gradient still alive), then the sharded gradient; the root's runs in autograd's
final callback, after every block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hardware.dtypes import DType
from hardware.profile import HardwareProfile
from planner.graph.layer_graph import LayerGraph
from planner.memory.types import CATEGORIES, Category
from planner.ops.base import ParamTensor
from planner.parallel.collectives import Collective, ParallelConfig, fsdp_shard_numel, ring_time_s
from planner.plan.knobs import GradSync
from planner.precision import PrecisionPolicy
from planner.timing.step_time import Collectives

_PARAMS = CATEGORIES.index(Category.PARAMS)
_GRADS = CATEGORIES.index(Category.GRADS)
_OPTIMIZER = CATEGORIES.index(Category.OPTIMIZER)
_DATA = CATEGORIES.index(Category.DATA)
_TEMPORARIES = CATEGORIES.index(Category.TEMPORARIES)

ROOT = "root"
# FSDP2's MixedPrecisionPolicy replaces autocast for bf16-mixed; fp16 would need a sharded grad
# scaler and fp8 Float8Linear's FSDP2 integration, neither modelled
FSDP_PRECISIONS = (PrecisionPolicy.FP32, PrecisionPolicy.TF32, PrecisionPolicy.BF16_MIXED, PrecisionPolicy.BF16_TRUE)


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call's parameters and the bytes of its buffers on rank 0."""

    name: str  # "root", "blocks.<i>", or "blocks.<i>.mlp.experts" (expert parallelism: nested in the block's)
    block: int | None
    params: tuple[str, ...]  # state-dict names, in registration order
    padded_numel: int  # S_U: padded shard elements per rank
    sharded_bytes: int  # sum_p r(s_p o): the sharded parameters
    gather_input_bytes: int  # AGin
    gather_output_bytes: int  # AG
    unsharded_bytes: int  # Ug
    reduce_input_bytes: int  # RSin
    sharded_grad_bytes: int  # RSo = Gs
    last_grad_bytes: int  # the last parameter's unsharded gradient, freed one call late (several ranks)
    accumulated_bytes: int = 0  # GradSync.LAST: unsharded gradients kept in the stored dtype, sum_p r(n_p o)
    last_accumulated_bytes: int = 0  # the last parameter's share of it
    upcast_peak_bytes: int = 0  # most gradient bytes while they are cast up one by one (see _upcast_peak)
    # parameters sharded along a dim other than 0 (stacked experts): FSDP2 copies each one's
    # all-gather output into a temporary before chunk-cat into the parameter, and (on several
    # ranks) its unsharded gradient into a dim-0-major copy (torch.cat of its chunks) before the
    # reduce-scatter (the largest one: each copy replaces its gradient)
    reordered_bytes: int = 0
    reordered_grad_bytes: int = 0
    world_size: int = 0  # ranks of its mesh (0: the layout's)
    nested: bool = False  # a module inside its block's unit (the experts under expert parallelism)


@dataclass(frozen=True)
class FsdpLayout:
    """FSDP2 units of one model on ``world_size`` ranks at ``stage`` 2 or 3."""

    stage: int
    world_size: int
    units: tuple[ShardUnit, ...]  # the root first, then the blocks in order
    grad_sync: GradSync = GradSync.EVERY
    replicas: int = 1  # HSDP: replicas of the shard group, its sharded gradients all-reduced across them

    @property
    def upcasts_grads(self) -> bool:
        """Under a MixedPrecisionPolicy the reduce dtype (the stored one) differs from the
        compute dtype: unsharded gradients held across micro-batches are cast up to it."""
        return any(u.gather_input_bytes for u in self.units)

    @property
    def root(self) -> ShardUnit:
        return self.units[0]

    @property
    def blocks(self) -> dict[int, ShardUnit]:
        return {u.block: u for u in self.units if u.block is not None and not u.nested}


def fsdp_layout(graph: LayerGraph, world_size: int, stage: int, stored_dtype: DType,
                round_bytes: Callable[[int], int], grad_sync: GradSync = GradSync.EVERY,
                expert_world_size: int | None = None, replicas: int = 1) -> FsdpLayout:
    """The units of ``graph`` (built in the compute precision) when sharded over ``world_size``
    ranks, parameters stored in ``stored_dtype`` (fp32 under a bf16 MixedPrecisionPolicy).
    Under expert parallelism each block's experts are a unit of their own (torchtitan's
    ``fully_shard(block.moe.experts, mesh=dp_mod_ep)`` before the block's), sharded over
    ``expert_world_size`` ranks (one: FSDP2 on a one-rank mesh, which still gathers and reduces).
    ``replicas`` > 1: HSDP, that many copies of the shard group (``fsdp_engine`` and
    ``fsdp_collectives`` add the all-reduce across them)."""
    if stage not in (2, 3) or world_size < 2:
        raise ValueError(f"FSDP2 layout needs stage 2 or 3 and several ranks, got stage {stage} on {world_size}")
    specs = graph.param_specs
    o, c = stored_dtype.n_bytes, graph.precision.param_dtype.n_bytes
    groups = _param_groups(graph)
    units = []
    for block, experts in _registration_order(groups):
        names = groups[(block, experts)]
        ranks = expert_world_size or world_size if experts else world_size
        name = ROOT if block is None else f"blocks.{block}" + (".mlp.experts" if experts else "")
        make = _one_rank_unit if ranks == 1 else _sharded_unit
        units.append(make(name, block, experts, names, ranks, specs, o, c, round_bytes))
    return FsdpLayout(stage=stage, world_size=world_size, units=tuple(units), grad_sync=grad_sync, replicas=replicas)


def _param_groups(graph: LayerGraph) -> dict[tuple[int | None, bool], list[str]]:
    """Parameter names by (block, is-expert) in first-use order; the root's (block None) always present.
    First use ~ registration order; tied weights belong to the root."""
    owner: dict[str, tuple[int | None, bool]] = {}
    for op in graph.nodes:
        for param in op.spec.params:
            owner.setdefault(param.name, (op.spec.block, param.expert_parallel))
    groups: dict[tuple[int | None, bool], list[str]] = {(None, False): []}
    for name, key in owner.items():
        groups.setdefault(key, []).append(name)
    return groups


def _registration_order(groups: Mapping[tuple[int | None, bool], list[str]]) -> list[tuple[int | None, bool]]:
    """Registration order of the units: the root, then each block, its experts first (fully_shard
    runs on the experts before their block; FSDP2's order is the modules' post-forward order)."""
    return sorted(groups, key=lambda k: (-1, 0) if k[0] is None else (k[0], 0 if k[1] else 1))


def _one_rank_unit(name: str, block: int | None, experts: bool, names: list[str], ranks: int,
                   specs: Mapping[str, ParamTensor], o: int, c: int, round_bytes: Callable[[int], int]) -> ShardUnit:
    """A unit under FSDP2 on one rank, which gathers nothing: each parameter's (cast) shard is copied out.
    (``ranks`` is 1; taken to match ``_sharded_unit``.)"""
    shards = [fsdp_shard_numel(specs[n], ranks) for n in names]
    total = sum(shards)
    casts = [round_bytes(s * c) for s in shards] if c != o else [0]
    return ShardUnit(
        name=name, block=block, world_size=1, nested=experts, params=tuple(names), padded_numel=total,
        sharded_bytes=sum(round_bytes(s * o) for s in shards), gather_input_bytes=max(casts, default=0),
        gather_output_bytes=0, unsharded_bytes=sum(round_bytes(s * c) for s in shards),
        reduce_input_bytes=round_bytes(total * o), sharded_grad_bytes=round_bytes(total * o),
        # foreach_reduce's loop over the gradients, whose variable keeps the last one alive
        # past the list's clear(), runs only on several ranks: nothing is freed late here
        last_grad_bytes=0, last_accumulated_bytes=0,
        accumulated_bytes=sum(round_bytes(specs[n].numel * o) for n in names),
        upcast_peak_bytes=_upcast_peak([round_bytes(specs[n].numel * o) for n in names],
                                       [round_bytes(specs[n].numel * c) for n in names]))


def _sharded_unit(name: str, block: int | None, experts: bool, names: list[str], ranks: int,
                  specs: Mapping[str, ParamTensor], o: int, c: int, round_bytes: Callable[[int], int]) -> ShardUnit:
    """A unit sharded over ``ranks`` > 1: the buffers of the module docstring's rules."""
    shards = [fsdp_shard_numel(specs[n], ranks) for n in names]
    total = sum(shards)
    return ShardUnit(
        name=name,
        block=block,
        world_size=ranks,
        nested=experts,
        params=tuple(names),
        padded_numel=total,
        sharded_bytes=sum(round_bytes(s * o) for s in shards),
        gather_input_bytes=round_bytes(total * c) if c != o else 0,
        gather_output_bytes=round_bytes(ranks * total * c),
        unsharded_bytes=sum(round_bytes(ranks * s * c) for s in shards),
        reduce_input_bytes=round_bytes(ranks * total * o),
        sharded_grad_bytes=round_bytes(total * o),
        last_grad_bytes=round_bytes(specs[names[-1]].numel * c) if names else 0,
        accumulated_bytes=sum(round_bytes(specs[n].numel * o) for n in names),
        last_accumulated_bytes=round_bytes(specs[names[-1]].numel * o) if names else 0,
        upcast_peak_bytes=_upcast_peak([round_bytes(specs[n].numel * o) for n in names],
                                       [round_bytes(specs[n].numel * c) for n in names]),
        reordered_bytes=sum(round_bytes(ranks * s * c) for n, s in zip(names, shards, strict=True)
                            if specs[n].shard_dim),
        # each copy replaces its gradient in foreach_reduce's list (the original dies with it):
        # one parameter's worth exists twice for a moment
        reordered_grad_bytes=max((round_bytes(ranks * s * c) for n, s in zip(names, shards, strict=True)
                                  if specs[n].shard_dim and ranks > 1), default=0),
    )


def _upcast_peak(upcast: list[int], compute: list[int]) -> int:
    """``to_accumulated_grad_if_needed`` runs parameter by parameter: casting the k-th, its fp32
    copy and every earlier one exist along with its own and every later bf16 gradient."""
    return max((sum(upcast[:k + 1]) + sum(compute[k:]) for k in range(len(upcast))), default=0)


def fsdp_collectives(layout: FsdpLayout, hw: HardwareProfile, parallel: ParallelConfig,
                     pipelined: bool = False, replicate: ParallelConfig | None = None) -> Collectives:
    """The collectives FSDP2 issues around one micro-batch (ring model, per rank).

    Every micro-batch all-gathers every unit for its forward (ZeRO-3: the blocks and the root
    again for the backward) and, in a backward that syncs, reduce-scatters every unit's gradients.
    FSDP2 overlaps a unit's all-gather with the previous unit's compute and a reduce-scatter with
    the next unit's backward; nothing runs before the root's all-gather, nor after its
    reduce-scatter (autograd's final callback): ``planner.timing.step_time`` places them so.

    ``pipelined``: a pipeline stage's, issued once per step (``planner.parallel.fsdp_pipeline``):
    the forward ones around its first forward, every reduce-scatter (the root's first) after its
    last backward, where ``perform_reduce_grad`` runs them and its final callback waits for them.

    ``replicate`` (HSDP: the ranks holding the same shard, one per replica): each unit's
    reduce-scatter output, the sharded gradient in the reduce dtype, is all-reduced across them
    right after its reduce-scatter (``foreach_reduce``), placed as the reduce-scatters are.
    """
    root, blocks = layout.root, [u for u in layout.units if u.block is not None]

    def over(units: Sequence[ShardUnit], kind: Collective, size: Callable[[ShardUnit], int]) -> float:
        """The units' collectives, each over its own mesh: the expert units' ranks (dp_shard / ep)
        are every ep-th of the data-parallel ranks, so fewer of them share a node."""
        total = 0.0
        units = [u for u in units if u.params]  # a stage root without parameters has no group: no collective
        for ranks in sorted({u.world_size or parallel.world_size for u in units}):
            group = [u for u in units if (u.world_size or parallel.world_size) == ranks]
            stride = max(1, parallel.world_size // ranks)
            config = ParallelConfig(world_size=ranks, gpus_per_node=max(1, parallel.gpus_per_node // stride))
            total += ring_time_s(sum(size(u) for u in group), kind, hw, config, len(group))
        return total

    def gather(units: Sequence[ShardUnit]) -> float:
        return over(units, Collective.ALL_GATHER, lambda u: u.gather_output_bytes)

    scatter = over(blocks, Collective.REDUCE_SCATTER, lambda u: u.reduce_input_bytes)
    scatter_root = over([root], Collective.REDUCE_SCATTER, lambda u: u.reduce_input_bytes)
    if replicate is not None and replicate.world_size > 1:
        def all_reduce(units: Sequence[ShardUnit]) -> float:
            units = [u for u in units if u.params]
            return ring_time_s(sum(u.sharded_grad_bytes for u in units), Collective.ALL_REDUCE, hw, replicate,
                               len(units))

        scatter += all_reduce(blocks)
        scatter_root += all_reduce([root])
    if pipelined:
        return Collectives(before_forward_s=gather([root]), during_forward_s=gather(blocks),
                           after_sync_backward_s=scatter_root + scatter)
    stage3 = layout.stage == 3
    return Collectives(
        before_forward_s=gather([root]),
        during_forward_s=gather(blocks),
        before_backward_s=gather([root]) if stage3 else 0.0,
        during_backward_s=gather(blocks) if stage3 else 0.0,
        during_sync_backward_s=scatter,
        after_sync_backward_s=scatter_root,
    )


def fsdp_bytes_moved(layout: FsdpLayout, parallel: ParallelConfig, grad_accum_steps: int,
                     pipelined: bool = False) -> float:
    """Bytes one rank sends in a step: every micro-batch's all-gathers (twice under ZeRO-3), the
    syncing micro-batches' reduce-scatters (ring: (N-1)/N of each collective's buffer) and under
    HSDP their outputs' all-reduces across the R replicas (2(R-1)/R of them); a ``pipelined``
    stage gathers and reduce-scatters once per step."""
    syncing = 1 if layout.grad_sync is GradSync.LAST or pipelined else grad_accum_steps
    factor = (parallel.world_size - 1) / parallel.world_size
    gathers = 1 if pipelined else grad_accum_steps * (2 if layout.stage == 3 else 1)
    gathered = sum(u.gather_output_bytes for u in layout.units)
    scattered = sum(u.reduce_input_bytes for u in layout.units)
    replicas = layout.replicas
    reduced = 2.0 * (replicas - 1) / replicas * sum(u.sharded_grad_bytes for u in layout.units if u.params)
    return factor * (gathers * gathered + syncing * scattered) + syncing * reduced


def shard_fraction(layout: FsdpLayout, n_params: int) -> float:
    """Share of the parameters rank 0's optimizer updates (its padded shards)."""
    if not n_params:
        return 0.0
    return min(1.0, math.fsum(u.padded_numel for u in layout.units) / n_params)
