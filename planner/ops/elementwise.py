"""Memory-bound elementwise ops: residual adds, GELU, SiLU, the SwiGLU product, dropout.

No matmul FLOPs (FlopCounterMode counts none); their time is the bytes they move.
"""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register

_RANK = {DType.BOOL: 0, DType.INT64: 1, DType.FP8: 2, DType.FP16: 3, DType.BF16: 3, DType.FP32: 4}


def promote(*dtypes: DType) -> DType:
    """torch's type promotion for the float dtypes we meet (bf16 + fp32 -> fp32)."""
    return max(dtypes, key=lambda d: _RANK[d])


@register(OpKind.RESIDUAL_ADD)
def residual_add_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``a + b``: saves nothing; backward hands the output grad to a same-shape, same-dtype input
    as is (no copy), casts it for an input of another dtype (bf16 branch into an fp32 stream
    under autocast) and sums it over broadcast dims for a smaller input (learned positions)."""
    a, b = ctx.inputs
    numel = max(a.numel, b.numel)
    dtype = promote(a.dtype, b.dtype)
    out = TensorInfo(numel=numel, dtype=dtype)
    aliases = tuple(t.numel == numel and t.dtype == dtype for t in ctx.inputs)
    return LayerCost(
        output=out,
        saves_inputs=(False, False),
        grad_aliases_inputs=aliases,
        fwd_bytes_moved=a.n_bytes + b.n_bytes + out.n_bytes,
        bwd_bytes_moved=sum(2 * t.n_bytes for t, alias in zip(ctx.inputs, aliases, strict=True) if not alias),
        bwd_kernels=sum(1 for alias in aliases if not alias),
    )


def _unary_saving_input(ctx: OpContext) -> LayerCost:
    """An elementwise op y = f(x) whose backward needs x: saves x, output of x's size and dtype;
    traffic: read x, write y forward; read grad, x, write dx backward."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=x.dtype)
    return LayerCost(
        output=out,
        saves_inputs=(True,),
        fwd_bytes_moved=2 * x.n_bytes,
        bwd_bytes_moved=3 * x.n_bytes,
    )


@register(OpKind.GELU)
def gelu_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """GELU (tanh approximation, GPT-2): saves its input (B, T, F); Korthikanti's "GeLU input 8sbh"."""
    return _unary_saving_input(ctx)


@register(OpKind.SILU)
def silu_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """SiLU ``x * sigmoid(x)`` (fused aten op): saves its input (B, T, F)."""
    return _unary_saving_input(ctx)


@register(OpKind.GLU_MUL)
def glu_mul_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """SwiGLU product ``silu(gate) * up`` (Shazeer 2020): saves both (B, T, F) operands. Each is
    saved only for the other's gradient (torch 2.13 derivatives.yaml ``mul.Tensor``; generated code
    saves under ``should_compute_output``): where one operand requires no grad (a fine-tuning plan's
    frozen projection on a frozen input) the other is not saved."""
    a, b = ctx.inputs
    out = TensorInfo(numel=a.numel, dtype=promote(a.dtype, b.dtype))
    return LayerCost(
        output=out,
        saves_inputs=(b.requires_grad, a.requires_grad),
        fwd_bytes_moved=a.n_bytes + b.n_bytes + out.n_bytes,
        bwd_bytes_moved=3 * out.n_bytes + a.n_bytes + b.n_bytes,
        bwd_kernels=2,
    )


@register(OpKind.DROPOUT)
def dropout_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``native_dropout``: a new output and a bool mask (1 byte per element) saved for backward
    (Korthikanti et al. 2022: "dropout mask sbh")."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=x.dtype)
    return LayerCost(
        output=out,
        saved_extra_bytes=(x.numel,),
        fwd_bytes_moved=2 * x.n_bytes + x.numel,
        bwd_bytes_moved=2 * x.n_bytes + x.numel,
    )


@register(OpKind.HEAD_MERGE_COPY)
def head_merge_copy_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``rearrange(out, "b n t h -> b t (n h)")`` of an attention output laid out head-major
    (B, N, T, H): the reshape cannot view it, so it copies (``clone`` then ``_unsafe_view``).
    SDPA lays its output out as its query: a query made by ``cat`` (partial rotary, transformers
    5.24.0 ``models/phi3/modeling_phi3.py`` ``apply_rotary_pos_emb``) is head-major, where the
    rotate-half of a (B, T, N, H) view keeps that layout and the merge is a view. Saves nothing;
    backward reshapes the gradient (a view, no copy)."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=x.dtype)
    return LayerCost(output=out, grad_aliases_inputs=(True,), fwd_bytes_moved=2 * x.n_bytes, bwd_kernels=0)
