"""Gemma's RMSNorm (transformers 5.24.0, ``models/gemma3/modeling_gemma3.py`` ``Gemma3RMSNorm``;
``models/gemma2/modeling_gemma2.py`` ``Gemma2RMSNorm`` is the same)::

    output = self._norm(x.float())          # x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)

run by the reference model as ``validate.models.dense.GemmaRMSNorm`` on every norm of a Gemma
block, the final norm and the per-head q/k norms. No matmul FLOPs.
"""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, OpVariant, TensorInfo
from planner.ops.registry import register_variant

_FP32 = DType.FP32


@register_variant(OpKind.RMSNORM, OpVariant.NORM_GEMMA)
def gemma_rmsnorm_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """x (e elements, R rows of ``in_features`` W) -> y of x's dtype.

    fp32 x (fp32 training; the fp32 residual stream under bf16-mixed): ``float()`` is x itself.
    Saved: x (by ``pow`` and the first ``mul``), rstd (4R), the normalised ``x * rstd`` (4e, by
    the second ``mul``, for w's gradient) and ``1 + w`` (4W, for x's); the output is the fp32
    product and ``type_as`` returns it. Low-precision x (a bf16 branch output or q/k under
    autocast, bf16-true): ``float()`` copies it (x32, 4e, saved in x's place; x is not saved),
    ``weight.float()`` copies a bf16 weight (transient), the fp32 product (4e) is cast back to
    x's dtype and freed. Backward as the written-out RMSNorm's (``planner.ops.norm``): two
    (B, T, D)-sized fp32 tensors beyond the gradients the walk counts, plus the fp32 gradient of a
    low-precision input before its cast back.
    """
    x = ctx.inputs[0]
    e = x.numel
    width = spec.in_features or e // ctx.tokens
    rows = e // width
    low = x.dtype is not _FP32
    out = TensorInfo(numel=e, dtype=x.dtype)
    one_plus_w = 4 * width
    weight_copy = 4 * width if ctx.precision.param_dtype is not _FP32 else 0
    saved = ((4 * e,) if low else ()) + (4 * rows, 4 * e, one_plus_w)
    return LayerCost(
        output=out,
        saves_inputs=(not low,),
        saved_extra_bytes=saved,
        fwd_transient_bytes=(4 * e if low else 0) + weight_copy,
        bwd_transient_bytes=8 * e + (4 * e if low else 0),
        fwd_bytes_moved=x.n_bytes + 20 * e + out.n_bytes,
        bwd_bytes_moved=40 * e,
        fwd_kernels=8 if low else 6,
        bwd_kernels=10,
        param_numel=sum(p.numel for p in spec.params),
        param_dtype=ctx.precision.param_dtype,
    )
