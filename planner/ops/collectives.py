"""Collectives of a parallel group as ops of one rank's program (tensor and sequence parallelism).

Named after Megatron-LM's mappings (``megatron/core/tensor_parallel/mappings.py``), which are
the autograd functions DTensor's ``parallelize_module`` styles amount to
(``torch/distributed/tensor/parallel/style.py``: ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput). ``g`` is the group size; x the op's input, local to the
rank. No FLOPs: the time is the collective's (``hardware.collectives``, NCCL's model), on the
critical path (eager PyTorch waits for it before the next op). Sizes of a collective are the
whole tensor's bytes, as NCCL and nccl-tests count them.

| op | forward | backward | memory |
|---|---|---|---|
| copy_to_region | x itself (``DTensor.from_local``: a view) | all-reduce of the input gradient | nothing new; the gradient is a new tensor |
| reduce_from_region | all-reduce of partial sums | the gradient passes through | a new output (out-of-place functional collective) |
| gather_from_sequence | all-gather along the sequence: g x | reduce-scatter | output g x; the all-gather lands on dim 0 and is concatenated along the sequence: one more g x while both exist |
| reduce_scatter_to_sequence | reduce-scatter along the sequence: x / g | all-gather | output x / g; the input is made contiguous per chunk first |
| scatter_to_sequence | this rank's chunk (a contiguous copy) | all-gather | output x / g |
| all_to_all | expert rows exchanged with the group (``all_to_all_single``, equal splits) | all-to-all of the gradient | output x; the gradient made contiguous first, replacing it |
"""

from __future__ import annotations

from hardware.collectives import Collective
from planner.ops.base import CollectiveCall, LayerCost, LayerSpec, MeshDim, OpContext, OpKind, TensorInfo
from planner.ops.registry import register


def _call(kind: Collective, n_bytes: float, spec: LayerSpec) -> CollectiveCall:
    """The collective of ``kind`` over ``n_bytes`` in the op's group (``spec.group_size`` ranks)."""
    return CollectiveCall(kind=kind, n_bytes=n_bytes, group_size=spec.group_size, ranks_per_node=spec.ranks_per_node)


@register(OpKind.COPY_TO_REGION)
def copy_to_region_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Megatron's ``copy_to_tensor_model_parallel_region`` (f): forward identity, backward
    all-reduce of the g ranks' partial input gradients (PrepareModuleInput: Replicate in, the
    colwise linears behind it return partial gradients)."""
    x = ctx.inputs[0]
    return LayerCost(
        output=TensorInfo(numel=x.numel, dtype=x.dtype),
        output_is_view=True,
        bwd_collectives=(_call(Collective.ALL_REDUCE, x.n_bytes, spec),),
        fwd_kernels=0,
        bwd_kernels=0,
    )


@register(OpKind.REDUCE_FROM_REGION)
def reduce_from_region_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Megatron's ``reduce_from_tensor_model_parallel_region`` (g): forward all-reduce of a
    rowwise linear's partial sums (RowwiseParallel, output Replicate), backward identity."""
    x = ctx.inputs[0]
    return LayerCost(
        output=TensorInfo(numel=x.numel, dtype=x.dtype),
        fwd_collectives=(_call(Collective.ALL_REDUCE, x.n_bytes, spec),),
        grad_aliases_inputs=(True,),
        fwd_kernels=0,
        bwd_kernels=0,
    )


@register(OpKind.GATHER_FROM_SEQUENCE)
def gather_from_sequence_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Megatron's ``gather_from_sequence_parallel_region``: forward all-gather of the sequence
    shards (PrepareModuleInput / ColwiseParallel with Shard(1) in, Replicate wanted), backward
    reduce-scatter of the gradient. The all-gather fills a (g B, T/g, D) buffer that is then
    concatenated into (B, T, D): both exist for a moment; the backward copies the gradient into
    per-rank contiguous chunks before its reduce-scatter."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel * spec.group_size, dtype=x.dtype)
    return LayerCost(
        output=out,
        fwd_collectives=(_call(Collective.ALL_GATHER, out.n_bytes, spec),),
        bwd_collectives=(_call(Collective.REDUCE_SCATTER, out.n_bytes, spec),),
        fwd_transient_bytes=out.n_bytes,
        bwd_transient_bytes=out.n_bytes,
        fwd_bytes_moved=2 * out.n_bytes,
        bwd_bytes_moved=2 * out.n_bytes,
        fwd_kernels=1,
        bwd_kernels=1,
    )


@register(OpKind.REDUCE_SCATTER_TO_SEQUENCE)
def reduce_scatter_to_sequence_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Megatron's ``reduce_scatter_to_sequence_parallel_region``: forward reduce-scatter of a
    rowwise linear's partial sums into sequence shards (RowwiseParallel, output Shard(1)),
    backward all-gather of the gradient."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel // spec.group_size, dtype=x.dtype)
    return LayerCost(
        output=out,
        fwd_collectives=(_call(Collective.REDUCE_SCATTER, x.n_bytes, spec),),
        bwd_collectives=(_call(Collective.ALL_GATHER, x.n_bytes, spec),),
        fwd_transient_bytes=x.n_bytes,
        bwd_transient_bytes=x.n_bytes,
        fwd_bytes_moved=2 * x.n_bytes,
        bwd_bytes_moved=2 * x.n_bytes,
        fwd_kernels=1,
        bwd_kernels=1,
    )


@register(OpKind.SCATTER_TO_SEQUENCE)
def scatter_to_sequence_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Megatron's ``scatter_to_sequence_parallel_region``: forward keeps this rank's sequence
    chunk of a replicated tensor (a contiguous copy, no communication), backward all-gathers
    the gradient."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel // spec.group_size, dtype=x.dtype)
    return LayerCost(
        output=out,
        bwd_collectives=(_call(Collective.ALL_GATHER, x.n_bytes, spec),),
        bwd_transient_bytes=x.n_bytes,
        fwd_bytes_moved=2 * out.n_bytes,
        bwd_bytes_moved=2 * x.n_bytes,
        bwd_kernels=1,
    )


@register(OpKind.ALL_TO_ALL)
def all_to_all_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Expert parallelism's dispatch or combine (torchtitan's ``all_to_all_single_autograd``):
    each rank sends 1/g of its rows to each rank of its expert-parallel group and receives as
    many (balanced routing: equal splits). Saves nothing; the backward is the same exchange of the
    gradient, which may arrive as a strided view (the rows' regrouping is a transpose) and is then
    made contiguous first: the copy replaces the incoming gradient (whose buffer dies with the
    view), so no more than one gradient-sized tensor beside the output exists at once (live-storage
    tracker, torch 2.13 ``all_to_all_single_autograd``)."""
    x = ctx.inputs[0]
    call = CollectiveCall(kind=Collective.ALL_TO_ALL, n_bytes=x.n_bytes, group_size=spec.group_size,
                          ranks_per_node=spec.ranks_per_node, dimension=MeshDim.EP)
    return LayerCost(
        output=TensorInfo(numel=x.numel, dtype=x.dtype),
        fwd_collectives=(call,),
        bwd_collectives=(call,),
        fwd_bytes_moved=2 * x.n_bytes,
        bwd_bytes_moved=4 * x.n_bytes,
        fwd_kernels=1,
        bwd_kernels=2,
    )
