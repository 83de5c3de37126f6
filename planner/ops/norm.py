"""Normalisations: LayerNorm (fused aten op) and RMSNorm (written out in the reference model)."""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register


def _norm_dtype(ctx: OpContext) -> DType:
    """CUDA autocast runs layer_norm, pow and rsqrt in fp32; our residual stream is fp32 there anyway."""
    return DType.FP32 if ctx.precision.autocast_dtype is not None else ctx.inputs[0].dtype


@register(OpKind.LAYERNORM)
def layernorm_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``native_layer_norm`` over D for B*T rows.

    Saves its input (B, T, D), weight, bias and two (B, T, 1) fp32 statistics (mean, rstd):
    Korthikanti et al. 2022 count the input (2sbh bytes in 16-bit) and ignore the statistics.
    No matmul FLOPs. Traffic: read x, write y; backward reads grad, x, stats and writes dx.
    """
    x = ctx.inputs[0]
    dtype = _norm_dtype(ctx)
    out = TensorInfo(numel=x.numel, dtype=dtype)
    rows = x.numel // (spec.in_features or x.numel // ctx.tokens)
    return LayerCost(
        output=out,
        saves_inputs=(True,),
        saved_extra_bytes=(rows * 4, rows * 4),
        fwd_bytes_moved=x.n_bytes + out.n_bytes,
        bwd_bytes_moved=2 * x.n_bytes + 2 * out.n_bytes,
        bwd_kernels=2,
        param_numel=sum(p.numel for p in spec.params),
        param_dtype=ctx.precision.param_dtype,
    )


@register(OpKind.RMSNORM)
def rmsnorm_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``(x * rsqrt(mean(x^2) + eps)) * w`` as separate aten ops (Zhang & Sennrich 2019).

    Saved for backward: x (by ``pow`` and the first ``mul``), rstd (B, T, 1) and the normalised
    ``x * rstd`` (B, T, D) (by the weight ``mul``). ``x^2`` is freed after the mean. Backward
    runs one autograd node per op: the weight ``mul``'s node is the output gradient's last reader
    (freed when the node returns, as the saved ``x * rstd`` is, unless the gradient is shared: a
    post-norm block's branch norm takes the residual stream's, which its add passes to both inputs);
    at the peak, in ``pow``'s node, the first input-gradient term, the mean's gradient, ``x^1``,
    its scaled copy and their product exist beside x: five (B, T, D) tensors, counted as the input
    gradient, the saved ``x * rstd`` (freed by then, standing in for one) and three transients;
    a shared output gradient is alive beside them (the walk frees an unshared one first).

    A frozen weight (a fine-tuning plan's base): the weight ``mul`` saves ``x * rstd`` only for
    the weight's gradient (``mul.Tensor`` in torch 2.13's derivatives.yaml, each operand saved
    only when the other's gradient is needed), so ``x * rstd`` is a forward transient instead.
    """
    x = ctx.inputs[0]
    dtype = _norm_dtype(ctx)
    out = TensorInfo(numel=x.numel, dtype=dtype)
    rows = x.numel // (spec.in_features or x.numel // ctx.tokens)
    u = x.numel * dtype.n_bytes
    frozen = bool(spec.params) and all(p.frozen for p in spec.params)
    return LayerCost(
        output=out,
        saves_inputs=(True,),
        saved_extra_bytes=(rows * dtype.n_bytes,) if frozen else (rows * dtype.n_bytes, u),
        fwd_transient_bytes=u if frozen else 0,
        fwd_bytes_moved=5 * u,
        bwd_bytes_moved=10 * u,
        fwd_kernels=6,
        bwd_kernels=9,
        bwd_transient_bytes=3 * u,
        releases_output_grad=True,
        param_numel=sum(p.numel for p in spec.params),
        param_dtype=ctx.precision.param_dtype,
    )
