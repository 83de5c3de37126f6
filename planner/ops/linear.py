"""Linear layers (projections, MLP, LM head): the matmuls that dominate FLOPs."""

from __future__ import annotations

from hardware.kernels import GemmShape
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, TensorInfo, linear_flops
from planner.ops.registry import register


@register(OpKind.LINEAR)
def linear_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``y = x W^T + b`` with x (B, T, I), W (O, I): one (B*T) x I x O matmul.

    FLOPs (lecture; FlopCounterMode's mm/addmm): forward 2*B*T*I*O; backward 2*B*T*I*O for the
    input gradient (only if the input requires grad) and 2*B*T*I*O for the weight gradient.

    Memory: ``addmm``/``mm`` on a flattened view save the input and the weight. Under autocast
    the input is cast to the low-precision dtype first (a new copy, saved instead of the input;
    autocast does not cache non-leaf casts, so q/k/v each keep their own copy) and the weight and
    bias casts are cached for the whole forward and saved. Backward then computes the input and
    weight gradients in low precision and casts them back (transients).
    """
    return _matmul_cost(spec, ctx, groups=1)


@register(OpKind.GROUPED_LINEAR)
def grouped_linear_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``bmm(x, W)`` with x (E, C, I), W (E, I, O): E experts' linears over C rows each (the
    reference MoE's experts; a grouped GEMM with equal groups).

    FLOPs (FlopCounterMode's bmm): forward 2*E*C*I*O, backward twice that. Memory as a linear's:
    bmm saves both operands, so the rows (or their autocast copy) and the weight (or its cached
    autocast copy); the low-precision weight gradient is a transient before its cast to fp32.
    """
    assert spec.moe is not None
    return _matmul_cost(spec, ctx, groups=spec.moe.n_experts)


def _matmul_cost(spec: LayerSpec, ctx: OpContext, groups: int) -> LayerCost:
    """A linear (``groups`` 1) or ``groups`` equal linears over as many groups of x's rows."""
    x = ctx.inputs[0]
    i, o = spec.in_features, spec.out_features
    tokens = x.numel // i
    low = ctx.precision.autocast_dtype
    out_dtype = low or x.dtype
    out = TensorInfo(numel=tokens * o, dtype=out_dtype)
    weight_numel = groups * (i * o + (o if spec.bias else 0))
    param_dtype = ctx.precision.param_dtype
    casts_input = low is not None and x.dtype != low
    saved_extra: tuple[int, ...] = ()
    autocast_copies: tuple[int, ...] = ()
    bwd_transient = 0
    if low is not None:
        autocast_copies = (groups * i * o * low.n_bytes,) + ((groups * o * low.n_bytes,) if spec.bias else ())
        bwd_transient = groups * i * o * low.n_bytes  # low-precision weight grad before its cast to fp32
    if casts_input:
        assert low is not None
        saved_extra = (x.numel * low.n_bytes,)
        bwd_transient += x.numel * low.n_bytes  # grad of the copy, before the cast back
    compute_bytes = out_dtype.n_bytes
    flops = linear_flops(tokens, i, o)
    return LayerCost(
        fwd_flops=flops,
        bwd_input_flops=flops if x.requires_grad else 0.0,
        bwd_weight_flops=flops,
        fwd_bytes_moved=(x.numel + groups * i * o + tokens * o) * compute_bytes,
        bwd_bytes_moved=(2 * tokens * o + 2 * x.numel + 2 * groups * i * o) * compute_bytes,
        fwd_kernels=1 + (2 if low is not None else 0),
        bwd_kernels=2 + (1 if spec.bias else 0),
        matmul=True,
        gemm=GemmShape(m=tokens // groups, n=o, k=i, batch=groups),
        output=out,
        saves_inputs=(not casts_input,),
        saved_extra_bytes=saved_extra,
        autocast_copy_bytes=autocast_copies,
        bwd_transient_bytes=bwd_transient,
        param_numel=weight_numel if spec.owns_params else 0,
        param_dtype=param_dtype,
        saves_before_compute=True,
    )
