"""Rotary position embedding (RoPE) on q and k, whole or partial (Su et al. 2021, RoFormer)."""

from __future__ import annotations

from planner.ops.base import AllocSequence, LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.elementwise import promote
from planner.ops.registry import register


@register(OpKind.ROTARY)
def rotary_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """RoPE on q (B, N, T, H) and k (B, K, T, H): ``x*cos + cat(-x2, x1)*sin`` (Su et al. 2021).

    Output q_rot and k_rot (new tensors). Saves only cos and sin (the ``mul`` by a tensor that
    needs no grad saves that tensor); under autocast they are first cast to the low dtype, one
    small copy each per block. Inside, per tensor: x*cos, -x2, cat, cat*sin, sum: three tensors
    of the size of x coexist at the peak.

    Partial rotary (``out_features`` R of ``in_features`` H dims per head rotated; transformers
    5.24.0 ``models/phi3/modeling_phi3.py`` ``apply_rotary_pos_emb``): the same on the (.., R)
    view ``x[..., :R]``, then ``cat([rotated, x[..., R:]], -1)``: a new (.., H) tensor, the
    rotated part freed after it.
    """
    q, k, rope = ctx.inputs
    dtype = promote(q.dtype, k.dtype)
    out = TensorInfo(numel=q.numel + k.numel, dtype=dtype)
    u_q, u_k = q.n_bytes, k.n_bytes
    partial = 0 < spec.out_features < spec.in_features
    seq = AllocSequence()
    for x in (u_q, u_k):
        u = x // spec.in_features * spec.out_features if partial else x  # the rotated part's bytes
        seq.alloc(u).alloc(u // 2).alloc(u).free(u // 2).alloc(u).free(u).alloc(u).free(2 * u)
        if partial:
            seq.alloc(x).free(u)
    casts_tables = rope.dtype != dtype
    table_copies = (rope.numel // 2 * dtype.n_bytes,) * 2 if casts_tables else ()
    return LayerCost(
        output=out,
        saves_inputs=(False, False, not casts_tables),
        saved_extra_bytes=table_copies,
        fwd_transient_bytes=seq.transient_over(out.n_bytes),
        bwd_transient_bytes=2 * max(u_q, u_k),
        fwd_bytes_moved=9 * (u_q + u_k),
        bwd_bytes_moved=10 * (u_q + u_k),
        fwd_kernels=10,
        bwd_kernels=12,
    )
