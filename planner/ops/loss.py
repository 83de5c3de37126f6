"""The loss: the fp32 upcast of the logits and the cross-entropy (log_softmax + nll_loss).

The logits are often the largest tensors of a step: B*T*V elements, and several coexist.
"""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
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
    return LayerCost(
        output=TensorInfo(numel=1, dtype=DType.FP32),
        saved_extra_bytes=(x.numel * DType.FP32.n_bytes, 4),
        fwd_bytes_moved=3 * x.n_bytes,
        bwd_bytes_moved=4 * x.n_bytes,
        fwd_kernels=2,
        bwd_kernels=2,
        bwd_transient_bytes=x.numel * DType.FP32.n_bytes,
    )
