"""The two elementwise ops peft's LoRA forward adds (peft 0.21.2, ``src/peft/tuners/lora/layer.py``,
``Linear.forward``: ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``, then
``result = result + lora_B(lora_A(dropout(x))) * scaling``): the input cast to the adapters' dtype
and the scale by ``alpha / rank``. ``SCALE`` also prices Gemma's scaled embedding (transformers 5.24.0
``models/gemma3/modeling_gemma3.py`` ``Gemma3TextScaledWordEmbedding.forward``: ``embedding(ids) *
self.embed_scale``, a 0-dim buffer of sqrt(hidden_size) cast to the weight's dtype; Gemma 2 multiplies
by a ``torch.tensor`` normalizer the same way): a scalar factor, so nothing of size is saved either."""

from __future__ import annotations

from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register


@register(OpKind.SCALE)
def scale_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``y = x * s``, y of x's shape (B, T, O) and dtype. ``mul.Tensor`` with a wrapped-number
    scalar: its derivative (torch 2.13 ``tools/autograd/derivatives.yaml``, ``mul.Tensor``:
    ``self: mul_tensor_backward(grad, other, self.scalar_type())``) needs only the scalar, so
    nothing of size is saved (measured with the tracker: only y's storage is added). Backward:
    one new gradient of x's size. Traffic: read x, write y; read grad, write dx."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=x.dtype)
    return LayerCost(output=out, saves_inputs=(False,), fwd_bytes_moved=2 * x.n_bytes, bwd_bytes_moved=2 * x.n_bytes)


@register(OpKind.ADAPTER_CAST)
def adapter_cast_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``x.to(dtype)``, ``dtype`` the adapters' (the plan's parameter dtype): peft's
    ``_cast_input_dtype`` (``src/peft/tuners/tuners_utils.py``) returns x itself when the dtypes
    match (the graph builder then drops the op, ``planner.graph.layer_graph``), else a new copy
    (under bf16-mixed a bf16 activation, the attention output or the SwiGLU product, copied to fp32),
    held by the forward's frame until it returns and saved by nothing (``_to_copy``'s backward
    keeps only the source dtype). Backward: the gradient cast back, a new tensor of x's size."""
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=ctx.precision.param_dtype)
    return LayerCost(output=out, saves_inputs=(False,), fwd_bytes_moved=x.n_bytes + out.n_bytes,
                     bwd_bytes_moved=x.n_bytes + out.n_bytes)
