"""Gemma's RMSNorm (transformers 5.24.0, ``models/gemma3/modeling_gemma3.py`` ``Gemma3RMSNorm``;
``models/gemma2/modeling_gemma2.py`` ``Gemma2RMSNorm`` is the same)::

    output = self._norm(x.float())          # x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)

run by the reference model as ``validate.models.dense.GemmaRMSNorm`` on every norm of a Gemma
block, the final norm and the per-head q/k norms. No matmul FLOPs.

Gemma 2's soft-capping (``models/gemma2/modeling_gemma2.py``): ``Gemma2ForCausalLM.forward``
caps the logits before the loss (``final_logit_softcapping``, ``LOGIT_SOFTCAP`` here) and
``eager_attention_forward`` the scores before the mask (``attn_logit_softcapping``, priced inside
the eager core, ``planner.ops.attention``, with ``softcap_forward``)::

    logits = logits / self.config.final_logit_softcapping
    logits = torch.tanh(logits)
    logits = logits * self.config.final_logit_softcapping
"""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.base import AllocSequence, LayerCost, LayerSpec, OpContext, OpKind, OpVariant, TensorInfo
from planner.ops.registry import register, register_variant

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


def softcap_forward(seq: AllocSequence, n_bytes: int, saved: bool) -> AllocSequence:
    """``c * tanh(s / c)`` of an ``n_bytes`` tensor s (freed by it: nothing saves s) into ``seq``:
    the quotient (``div.Tensor`` by a Python float saves only the scalar), tanh's output (saved
    by ``tanh_backward``, which reads the result), the quotient dies, the product (``mul`` by a
    float saves nothing). Not ``saved`` (inside a checkpointed unit): tanh's output dies after
    the product. The product is left allocated."""
    seq.alloc(n_bytes).free(n_bytes)  # s / c, s dies
    seq.alloc(n_bytes).free(n_bytes)  # tanh, the quotient dies
    seq.alloc(n_bytes)  # * c
    if not saved:
        seq.free(n_bytes)  # tanh's output
    return seq


@register(OpKind.LOGIT_SOFTCAP)
def logit_softcap_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``z / c``, ``tanh``, ``* c`` of the (B, T, V) logits z (``Gemma2ForCausalLM.forward``,
    transformers 5.24.0): y of z's shape (e elements) and dtype (bf16 under autocast: none of the
    three is on autocast's lists; the loss's ``.float()`` follows). Saved: tanh's output (e of
    z's dtype); z and the quotient are saved by nothing and freed (z after this op, the quotient
    inside it, so the forward peak is z, the quotient and tanh's output: no transient beyond z,
    y and the saved tensor). Backward (``MulBackward1`` -> ``TanhBackward0`` -> ``DivBackward1``):
    grad * c (the output gradient then dies), ``tanh_backward(g, y)`` (g and y die), g / c:
    at most two e-sized gradients at once, one beyond z's gradient. No FLOPs (FlopCounterMode
    counts none); traffic: 6e forward, 7e backward (tanh_backward reads two), of z's dtype."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=x.dtype)
    n = x.n_bytes
    return LayerCost(
        output=out,
        saves_inputs=(False,),
        saved_extra_bytes=(n,),
        extras_are_outputs=True,  # tanh's output: a kernel's output, as SAC's cache keeps it
        unsaved_fwd_transient_bytes=n,  # in a checkpointed unit: the quotient beside tanh's output, then y
        bwd_transient_bytes=n,
        releases_output_grad=True,
        fwd_bytes_moved=6 * n,
        bwd_bytes_moved=7 * n,
        fwd_kernels=3,
        bwd_kernels=3,
    )
