"""Llama 4's attention ops around the core, as the reference model runs them
(``validate.models.llama4``, after transformers 5.24.0 ``models/llama4/modeling_llama4.py``
``Llama4TextAttention``): the weightless L2 norm of q and k on the RoPE blocks and the
temperature of q on the no-RoPE blocks. Neither does matmul FLOPs (FlopCounterMode counts none);
their time is the bytes they move.

Notation: M_q = B N T H and M_k = B K T H elements of q and k, rows M / H, u = 4 M (fp32), s the
stream's element size.
"""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.base import AllocSequence, LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register

_F32 = DType.FP32.n_bytes


@register(OpKind.QK_L2_NORM)
def qk_l2_norm_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``Llama4TextL2Norm`` on q, then on k (the rotary's output, q and k as one input):
    ``(x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)``, ``x32 = x.float()``.

    Saved per tensor: x32 (by ``pow`` and the product; x itself in fp32, else its fp32 copy) and
    rstd (rows, fp32). Forward temporaries: x^2 (u), the (rows) mean and sum, and in low
    precision the fp32 product beside the cast-back output. Backward per tensor (k first): the
    output gradient cast to fp32, the product's two gradients (u each), the mean's expanded
    gradient and pow's, summed into x32's gradient, cast back. Measured with the live-storage
    tracker (fp32 and bf16, q and k of (2, 4|2, 64, 32)): the peak, in q's backward, is 4 u_q
    beyond the input gradients, less the rstd the nodes have released by then.
    """
    x = ctx.inputs[0]
    n, k = spec.n_heads, spec.n_kv_heads
    parts = (x.numel * n // (n + k), x.numel * k // (n + k))
    low = x.dtype is not DType.FP32
    seq = AllocSequence()
    extras: list[int] = []
    for numel in parts:
        u, r, out = _F32 * numel, _F32 * (numel // spec.head_dim), x.dtype.n_bytes * numel
        if low:
            seq.alloc(u)  # x32, saved
        seq.alloc(u).alloc(r).free(u).alloc(r).free(r).alloc(r).free(r)  # pow, mean, + eps, rsqrt (saved)
        seq.alloc(u)  # the product (the output in fp32)
        if low:
            seq.alloc(out).free(u)  # cast back; the product dies
        extras += [u, r] if low else [r]
    output = TensorInfo(numel=x.numel, dtype=x.dtype)
    u_q, rstd = _F32 * parts[0], _F32 * x.numel // spec.head_dim
    return LayerCost(
        output=output,
        saves_inputs=(not low,),
        saved_extra_bytes=tuple(extras),
        fwd_transient_bytes=seq.transient_over(sum(extras) + output.n_bytes),
        bwd_transient_bytes=4 * u_q - rstd,
        releases_output_grad=True,  # q's and k's output gradients are read first (cast or product) and freed
        fwd_bytes_moved=x.n_bytes + 6 * _F32 * x.numel + output.n_bytes,
        bwd_bytes_moved=2 * x.n_bytes + 10 * _F32 * x.numel,
        fwd_kernels=12 if low else 10, bwd_kernels=16,
    )


@register(OpKind.ATTN_TEMPERATURE)
def attn_temperature_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``(q * scales.view(1, 1, T, 1)).to(q.dtype)``, scales ``log1p(floor((arange(T) + 1) /
    floor_scale)) * attn_scale + 1`` in fp32 (T-sized temporaries).

    The product saves the (T,) scales (q's gradient needs them; they need none); a low-precision q
    is promoted to an fp32 product (u), cast back. Backward: the gradient cast to fp32, times the
    scales (u each), cast back to q's dtype (the input gradient)."""
    q = ctx.inputs[0]
    low = q.dtype is not DType.FP32
    u = _F32 * q.numel
    scales = _F32 * ctx.seq_len
    output = TensorInfo(numel=q.numel, dtype=q.dtype)
    return LayerCost(
        output=output,
        saves_inputs=(False,),
        saved_extra_bytes=(scales,),
        fwd_transient_bytes=u if low else 0,
        bwd_transient_bytes=2 * u if low else 0,
        fwd_bytes_moved=q.n_bytes + output.n_bytes + (2 * u if low else 0),
        bwd_bytes_moved=2 * q.n_bytes + (4 * u if low else 0),
        fwd_kernels=9 if low else 8, bwd_kernels=3 if low else 1,
    )
