"""Inputs to the blocks: token embedding, learned positions, rotary tables, the causal mask."""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.base import AllocSequence, LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register


@register(OpKind.EMBEDDING)
def embedding_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Token embedding ``W[V, D][ids]``: gathers B*T rows.

    Output (B, T, D) in the parameter dtype (autocast leaves ``embedding`` in fp32). Saves only
    the int64 ids, which are part of the data batch. Backward (``embedding_dense_backward``)
    writes a zero (V, D) gradient and scatter-adds B*T rows into it; no matmul FLOPs
    (FlopCounterMode counts none).
    """
    d = spec.out_features
    dtype = ctx.precision.param_dtype
    out = TensorInfo(numel=ctx.tokens * d, dtype=dtype)
    return LayerCost(
        output=out,
        fwd_bytes_moved=ctx.tokens * 8 + 2 * out.n_bytes,
        bwd_bytes_moved=spec.in_features * d * dtype.n_bytes + 2 * out.n_bytes,
        bwd_kernels=2,
        param_numel=sum(p.numel for p in spec.params),
        param_dtype=dtype,
    )


@register(OpKind.POS_EMBEDDING)
def pos_embedding_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Learned positions ``P[max_seq_len, D][arange(T)]``: output (T, D), broadcast over the batch.

    The int64 ``arange(T)`` it indexes with is saved for backward (T * 8 bytes).
    """
    d = spec.out_features
    dtype = ctx.precision.param_dtype
    out = TensorInfo(numel=ctx.seq_len * d, dtype=dtype)
    return LayerCost(
        output=out,
        saved_extra_bytes=(ctx.seq_len * 8,),
        fwd_bytes_moved=2 * out.n_bytes,
        bwd_bytes_moved=spec.in_features * d * dtype.n_bytes + 2 * out.n_bytes,
        fwd_kernels=2,
        bwd_kernels=2,
        param_numel=sum(p.numel for p in spec.params),
        param_dtype=dtype,
    )


@register(OpKind.ROPE_TABLES)
def rope_tables_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """cos and sin tables (T, H), computed once per forward in fp32, cast to the residual dtype.

    ``outer(arange(T), inv_freq)`` (T, H/2) fp32 -> ``cat`` (T, H) -> cos, sin (T, H) fp32 ->
    cast. No gradient; every block's rotary saves them, so they live until the last backward.
    """
    th = ctx.seq_len * spec.head_dim
    dtype = ctx.inputs[0].dtype if ctx.inputs else ctx.precision.param_dtype
    out = TensorInfo(numel=2 * th, dtype=dtype, requires_grad=False)
    seq = AllocSequence().alloc(th * 2).alloc(th * 4).free(th * 2).alloc(th * 4).alloc(th * 4)
    if dtype is not DType.FP32:
        seq.alloc(2 * th * dtype.n_bytes).free(2 * th * 4)
    return LayerCost(
        output=out,
        fwd_transient_bytes=seq.transient_over(out.n_bytes),
        fwd_bytes_moved=6 * th * 4,
        fwd_kernels=8,
        has_backward=False,
    )


@register(OpKind.CAUSAL_MASK)
def causal_mask_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``ones(T, T, bool).triu(1)``: built once per forward for eager attention, shared by all blocks.

    With a window W (``spec.window``, the sliding layers' mask): ``causal | ones(T, T).tril(-W)``,
    also masking the keys W or more behind the query; the same bytes (ones, tril, then their or)."""
    t2 = ctx.seq_len * ctx.seq_len
    return LayerCost(
        output=TensorInfo(numel=t2, dtype=DType.BOOL, requires_grad=False),
        fwd_transient_bytes=t2,
        fwd_bytes_moved=3 * t2,
        fwd_kernels=2,
        has_backward=False,
    )
