"""The loss: the fp32 upcast of the logits and the cross-entropy (log_softmax + nll_loss).

The logits are often the largest tensors of a step: B*T*V elements, and several coexist.
"""

from __future__ import annotations

from hardware.collectives import Collective
from hardware.dtypes import DType
from planner.ops.base import CollectiveCall, LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register


@register(OpKind.CAST)
def cast_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``logits.float()``: a new fp32 (B, T, V) copy (the low-precision logits are then freed,
    nothing saves them). Backward casts the fp32 grad back: a new (B, T, V) low-precision tensor."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=DType.FP32)
    return LayerCost(
        output=out,
        fwd_bytes_moved=x.n_bytes + out.n_bytes,
        bwd_bytes_moved=x.n_bytes + out.n_bytes,
    )


@register(OpKind.CROSS_ENTROPY)
def cross_entropy_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``F.cross_entropy`` = ``log_softmax`` (saves its (B*T, V) output) + ``nll_loss`` (saves the
    targets, already in the batch, and a scalar total weight); output a scalar.

    Backward: ``nll_loss_backward`` writes a (B*T, V) gradient of the log-probabilities (a
    transient) and ``_log_softmax_backward_data`` turns it into the (B*T, V) logits gradient, so
    three (B*T, V) fp32 tensors coexist at the start of backward.
    """
    x = ctx.inputs[0]
    if spec.group_size > 1:
        return _loss_parallel_cost(spec, ctx)
    return LayerCost(
        output=TensorInfo(numel=1, dtype=DType.FP32),
        saved_extra_bytes=(x.numel * DType.FP32.n_bytes, 4),
        fwd_bytes_moved=3 * x.n_bytes,
        bwd_bytes_moved=4 * x.n_bytes,
        fwd_kernels=2,
        bwd_kernels=2,
        bwd_transient_bytes=x.numel * DType.FP32.n_bytes,
    )


def _loss_parallel_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Cross-entropy over vocabulary-sharded logits under ``loss_parallel()`` (x: this rank's
    (B*T, V/t) fp32 logits; torch/distributed/tensor/parallel/loss.py). The log-softmax is
    written out: ``shifted = x - allreduce_max(amax(x))``, ``exp(shifted)``, its row sums
    all-reduced, ``shifted - log(sum)`` saved as the log-probabilities: x, ``shifted`` and
    ``exp`` (then the result) exist at once, one (B*T, V/t) more than a fused log_softmax keeps.
    The target logit is gathered under a mask and all-reduced. Backward (one handler for both
    ops, ``_nll_loss_and_log_softmax_backward``): ``(zeros_like(x) + exp(logp)) * grad``, with
    the zeros, the exp or the sum, and the product alive together: two (B*T, V/t) more than the
    logits gradient. Three all-reduces of B*T fp32 values per forward; none in the backward."""
    x = ctx.inputs[0]
    local = x.numel * DType.FP32.n_bytes
    rows = ctx.tokens
    return LayerCost(
        output=TensorInfo(numel=1, dtype=DType.FP32),
        saved_extra_bytes=(local, 4),
        fwd_transient_bytes=local,
        bwd_transient_bytes=2 * local,
        fwd_collectives=(CollectiveCall(kind=Collective.ALL_REDUCE, n_bytes=3 * rows * 4, group_size=spec.group_size,
                                        ranks_per_node=spec.ranks_per_node),),
        fwd_bytes_moved=6 * x.n_bytes,
        bwd_bytes_moved=6 * x.n_bytes,
        fwd_kernels=9,
        bwd_kernels=6,
    )
