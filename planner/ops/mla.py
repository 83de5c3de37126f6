"""Multi-head latent attention's own ops (``planner.model.families.deepseek.blocks``, as
``validate.models.deepseek.MlaAttention`` runs them; transformers 5.24.0's ``DeepseekV3Attention``).

Notation: N heads, n = qk_nope_head_dim, r = qk_rope_head_dim, q = n + r, v = v_head_dim, and
``tokens`` B T. Its projections are linears, its latent norms fp32 RMSNorms, its rotary the
rotate-half RoPE on the rope parts only (q's (B, N, T, r), the shared key's (B, 1, T, r)), its
core the fused attention with query/key head dim q and value head dim v (planner.ops.attention).
None of these ops does matmul FLOPs (FlopCounterMode counts none); their time is the bytes they move.
"""

from __future__ import annotations

from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register


@register(OpKind.SLICE)
def slice_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``x[..., a:a + keep]`` of ``of`` columns per row (``out_features`` of ``in_features``): a
    view of x, which it keeps alive while it lives. Backward (``slice_backward``): a zeroed
    gradient of x's whole shape with this slice's gradient copied in (the input gradient itself;
    a second slice of the same x adds its own into it)."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel // spec.in_features * spec.out_features, dtype=x.dtype)
    return LayerCost(
        output=out,
        output_is_view=True,
        fwd_bytes_moved=0,
        fwd_kernels=0,
        bwd_bytes_moved=x.n_bytes + 2 * out.n_bytes,
        bwd_kernels=2,
    )


@register(OpKind.MLA_CONCAT)
def mla_concat_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``cat((nope, rope), -1)``: a query (B, N, T, q) from its (B, N, T, n) and rotated (B, N, T, r)
    parts, or a key from its nope part and the one rotated key head expanded over the N heads (a
    view). ``ctx.inputs``: the nope part and the rotary op's output (q's and the key's rope parts
    together); ``in_features`` n, ``out_features`` q, ``n_kv_heads`` the rope part's heads (N for
    the query, 1 for the key). Saves nothing. Backward: cat hands each part a slice of the output
    gradient (views, no copy); the key's expanded rope part is summed back over the heads: a new
    (B, 1, T, r) gradient (the rotary output's gradient is counted as a tensor of its own there)."""
    nope, rot = ctx.inputs
    out = TensorInfo(numel=nope.numel // spec.in_features * spec.out_features, dtype=nope.dtype)
    shared_rope = spec.n_kv_heads < spec.n_heads
    return LayerCost(
        output=out,
        grad_aliases_inputs=(True, not shared_rope),
        fwd_bytes_moved=2 * out.n_bytes,
        bwd_bytes_moved=(2 * out.n_bytes // spec.out_features * (spec.out_features - spec.in_features)
                         if shared_rope else 0),
        fwd_kernels=1,
        bwd_kernels=1 if shared_rope else 0,
    )
