"""How other implementations run the ops the reference model also runs (``OpVariant``).

Each formula is transcribed from the library's source at a named version (the module docstring
of ``planner.graph.implementations`` lists them) and checked against the live-storage tracker over the
real library code (tests/planner/test_implementations.py, tests/validate/test_hf_implementation.py).
Notation as in ``planner.ops.base``: B micro-batch, T seq_len, D d_model, F d_ff, N heads,
K kv heads, H head dim; ``e`` is an input's element count, ``R = B*T`` its rows.
"""

from __future__ import annotations

from hardware.dtypes import DType
from planner.ops.attention import eager_attention_cost
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, OpVariant, TensorInfo
from planner.ops.embedding import rope_tables_cost
from planner.ops.linear import linear_cost
from planner.ops.loss import cross_entropy_cost
from planner.ops.norm import rmsnorm_cost
from planner.ops.registry import register_variant

_FP32 = DType.FP32


@register_variant(OpKind.RMSNORM, OpVariant.NORM_FP32)
def rmsnorm_fp32_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """transformers 5.24.0 ``LlamaRMSNorm`` (also Mistral's and Qwen2's), modeling_llama.py::

        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    An fp32 input (fp32, and the fp32 residual stream under bf16-mixed) runs exactly as the
    reference's written-out RMSNorm. A bf16 input (bf16-true) is first copied to fp32: saved are
    that copy x32 (4e bytes, by ``pow`` and the first ``mul``), the fp32 rstd (4R) and the
    normalised bf16 copy (2e, by the weight ``mul``); the input itself is not saved (``to``
    saves nothing). The fp32 product (4e) lives until ``forward`` returns. Output bf16 (2e).
    Backward (measured op by op): the ``pow`` node runs with the first input-gradient term,
    ``mean``'s expanded gradient, ``x32^1``, its scaled copy and the product alive, five fp32
    (B, T, D) tensors beside x32: 14e beyond what the walk counts (x32, the output and input
    gradients). Inside a checkpointed block nothing is saved: x32 with ``x32^2`` (or with the
    product) is the peak, 6e over the output.
    """
    x = ctx.inputs[0]
    if x.dtype is _FP32:
        return rmsnorm_cost(spec, ctx)
    e, rows = x.numel, x.numel // (spec.in_features or x.numel // ctx.tokens)
    out = TensorInfo(numel=e, dtype=x.dtype)
    frozen = bool(spec.params) and all(p.frozen for p in spec.params)  # the bf16 copy is saved only for w's grad
    return LayerCost(
        output=out,
        saves_inputs=(False,),
        saved_extra_bytes=(4 * e, 4 * rows) if frozen else (4 * e, 4 * rows, out.n_bytes),
        fwd_transient_bytes=4 * e + 4 * rows + (out.n_bytes if frozen else 0),
        unsaved_fwd_transient_bytes=6 * e + 12 * rows,
        bwd_transient_bytes=14 * e,
        fwd_bytes_moved=x.n_bytes + 16 * e + 2 * out.n_bytes,
        bwd_bytes_moved=40 * e,
        fwd_kernels=7,
        bwd_kernels=11,
        param_numel=sum(p.numel for p in spec.params),
        param_dtype=ctx.precision.param_dtype,
    )


@register_variant(OpKind.RMSNORM, OpVariant.NORM_FUSED)
def rmsnorm_fused_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``F.rms_norm`` as CUDA runs it in torch 2.13: ``rms_norm_symint`` calls the fused
    ``_fused_rms_norm`` kernel (aten/src/ATen/native/layer_norm.cpp), whose autograd formula
    (tools/autograd/derivatives.yaml) saves the input, the weight and ``result1``, the per-row
    rstd in the accumulation type (fp32 for fp32 and bf16 inputs): x (the residual stream) and
    4R bytes. Output in the input's dtype; no temporaries beyond the kernel's registers. The
    backward kernel (``_fused_rms_norm_backward``) writes dX and dW directly. torchtitan 0.3.0's
    RMSNorm is ``nn.RMSNorm`` (torchtitan/models/common/nn_modules.py), so it runs this kernel.

    On CPU torch 2.13 decomposes ``F.rms_norm`` (upcast, ``pow``, ``mean``, ``rsqrt``, two
    ``mul``): ``validate`` swaps in an autograd function that saves what the CUDA kernel saves
    (``validate.implementations.FusedRMSNorm``), so simulate measures the GPU's allocations.
    """
    x = ctx.inputs[0]
    out = TensorInfo(numel=x.numel, dtype=x.dtype)
    return LayerCost(
        output=out,
        saves_inputs=(True,),
        saved_extra_bytes=(4 * ctx.tokens,),
        fwd_bytes_moved=x.n_bytes + out.n_bytes,
        bwd_bytes_moved=2 * x.n_bytes + 2 * out.n_bytes,
        bwd_kernels=2,
        param_numel=sum(p.numel for p in spec.params),
        param_dtype=ctx.precision.param_dtype,
    )


def _written_gelu(ctx: OpContext, saved_units: int, unsaved_units: int, upcasts_pow: bool) -> LayerCost:
    """A GELU written out in Python ops (x: the up projection's output, e elements, u bytes).

    ``saved_units`` tensors of x's size are saved besides x. The forward ends at its peak (every
    intermediate before the last product is freed or saved); inside a checkpointed block nothing
    is saved and ``unsaved_units`` tensors of x's size exist beside the output at the peak. The
    backward's peak is its first node, the last product's: the output gradient times each saved
    factor, one x-sized tensor beyond the output and input gradients (measured).

    Under CUDA autocast ``pow`` is on the fp32 list (aten/src/ATen/autocast_mode.cpp): x (bf16)
    is cast to an fp32 copy that ``pow`` saves instead of x, and every later op is promoted to
    fp32: saved are that copy, ``tanh``'s result and ``1 + tanh`` (4e each) and ``0.5 x`` (2e),
    the output is fp32 (the down projection casts it back), and the backward's first node holds
    the fp32 output gradient and both fp32 products (8e) before it casts one to bf16: 6e beyond
    the output and input gradients (measured in transformers' GPT-2 under the tracker). CPU autocast does not upcast ``pow``; ``validate`` applies
    CUDA's fp32 list when it simulates (``validate.implementations``)."""
    x = ctx.inputs[0]
    e = x.numel
    if upcasts_pow and ctx.precision.autocast_dtype is not None:
        d = x.dtype.n_bytes
        out = TensorInfo(numel=e, dtype=_FP32)
        return LayerCost(output=out, saves_inputs=(False,), saved_extra_bytes=(4 * e, 4 * e, 4 * e, d * e),
                         unsaved_fwd_transient_bytes=6 * e, bwd_transient_bytes=6 * e,
                         fwd_bytes_moved=40 * e, bwd_bytes_moved=60 * e, fwd_kernels=8, bwd_kernels=12)
    u = x.n_bytes
    return LayerCost(output=TensorInfo(numel=e, dtype=x.dtype), saves_inputs=(True,),
                     saved_extra_bytes=(u,) * saved_units, unsaved_fwd_transient_bytes=unsaved_units * u,
                     bwd_transient_bytes=u, fwd_bytes_moved=14 * u, bwd_bytes_moved=20 * u,
                     fwd_kernels=8, bwd_kernels=12)


@register_variant(OpKind.GELU, OpVariant.GELU_NEW)
def gelu_new_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """transformers 5.24.0 ``NewGELUActivation`` (activations.py; GPT2Config's default
    ``activation_function``)::

        0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))

    Eight aten ops on (B, T, F) tensors. ``pow`` saves the input, ``tanh`` its result, the last
    ``mul`` both ``0.5 * input`` and ``1 + tanh``: three (B, T, F) tensors more than the fused
    ``gelu_pytorch_tanh`` (which saves only its input). The scalar products and sums save
    nothing, so the forward peaks where it ends; inside a checkpointed block ``0.5 x``,
    ``x^3`` and its product coexist (two beside the output)."""
    return _written_gelu(ctx, 3, 2, upcasts_pow=True)


@register_variant(OpKind.GELU, OpVariant.GELU_FAST)
def gelu_fast_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """transformers 5.24.0 ``FastGELUActivation`` (activations.py)::

        0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))

    No ``pow``: every op stays in the input's dtype. Saved besides the input: ``0.044715 *
    input`` and ``input * 0.7978845608`` (by the products that use them), ``1 + 0.044715 x^2``,
    ``tanh``'s result, ``1 + tanh`` and ``0.5 * input``: six (B, T, F) tensors (three beside
    the output inside a checkpointed block)."""
    return _written_gelu(ctx, 6, 3, upcasts_pow=False)


@register_variant(OpKind.LINEAR, OpVariant.SHARED_CAST)
def shared_cast_linear_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """k and v of a fused q/k/v projection (transformers 5.24.0 GPT-2's ``c_attn``, a
    ``Conv1D`` of 3D outputs, modeling_gpt2.py; torchtitan 0.3.0's ``FusedQKVLinear.wqkv``):
    one matmul, so under autocast the input is cast to the low dtype once and that copy is
    saved once (priced on q). Otherwise as the reference linear: the same FLOPs, outputs and
    weight copies (one (3D, D) cast is the three (D, D) casts' bytes)."""
    cost = linear_cost(spec, ctx)
    if not cost.saved_extra_bytes:
        return cost
    return cost.model_copy(update={"saved_extra_bytes": ()})


@register_variant(OpKind.LINEAR, OpVariant.SPLIT_COPIES)
def split_copies_linear_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """The v projection of torchtitan 0.3.0's ``FusedQKVLinear`` (torchtitan/models/common/
    attention.py): ``qkv = self.wqkv(x)`` of (N + 2K) H columns, viewed as (B, T, K, N/K + 2, H),
    ``torch.split`` along the group and each part ``reshape(...).contiguous()``: q, k and v are
    copies, and the fused output dies when ``forward`` returns. Priced as three projections whose
    last one, here, also holds the fused output (B T (N + 2K) H) while the copies are made; the
    input cast under autocast is q's (as ``SHARED_CAST``)."""
    cost = shared_cast_linear_cost(spec, ctx)
    fused = ctx.tokens * (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim * cost.output.dtype.n_bytes
    return cost.model_copy(update={"fwd_transient_bytes": cost.fwd_transient_bytes + fused,
                                   "fwd_bytes_moved": cost.fwd_bytes_moved + 2 * fused})


@register_variant(OpKind.ROPE_TABLES, OpVariant.ROPE_BUFFERS)
def rope_cache_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """torchtitan 0.3.0's RoPE buffers (torchtitan/models/common/rope.py): every attention's
    ``ComplexRoPE`` registers ``cache = polar(1, outer(arange(max_seq_len), freqs))``, complex64
    (max_seq_len, H/2), and the trainer sets max_seq_len to the training seq_len
    (``Decoder.Config.update_from_config``): L buffers of 4 T H bytes (``spec.in_features``
    carries L, ``spec.head_dim`` H). A buffer, not an activation: it exists through the whole step; the walk keeps it
    from the start of the forward to the last block's rotary backward (each saves a view of it)."""
    layers = max(spec.in_features, 1)
    return LayerCost(output=TensorInfo(numel=layers * ctx.seq_len * spec.head_dim, dtype=_FP32, requires_grad=False),
                     fwd_kernels=0, bwd_kernels=0, has_backward=False)


@register_variant(OpKind.ROTARY, OpVariant.COMPLEX_ROTARY)
def complex_rotary_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """torchtitan 0.3.0 ``ComplexRoPE`` (torchtitan/models/common/rope.py), with the per-document
    positions its dataloader always passes::

        cache = rope_cache[positions.squeeze(0)]          # B = 1: (T, H/2) complex64
        cache = torch.gather(rope_cache[None, :, None, :].expand(B, ...), 1, positions...)  # B > 1
        xq_ = torch.view_as_complex(query.float().reshape(*query.shape[:-1], -1, 2))
        xq_out = torch.view_as_real(xq_ * cache).flatten(3)
        return xq_out.type_as(query), ...

    The gathered cache (4 T H bytes, times B when B > 1) is what the complex ``mul`` saves (q
    and k need no other tensor: the cache needs no gradient). Per tensor x (u bytes, e elements):
    an fp32 copy unless x is fp32 (4e) and the complex product (4e), locals until
    ``apply_rotary_emb`` returns, then the cast back (the output; the product itself when fp32).
    Backward per tensor: the gradient cast to fp32 and its complex product (8e) unless fp32."""
    q, k, _cache = ctx.inputs
    out = TensorInfo(numel=q.numel + k.numel, dtype=q.dtype)
    low = q.dtype is not _FP32
    gathered = 4 * (ctx.tokens if ctx.batch > 1 else ctx.seq_len) * spec.head_dim
    fwd = 8 * (q.numel + k.numel) if low else 0
    return LayerCost(
        output=out,
        saves_inputs=(False, False, True),
        saved_extra_bytes=(gathered,),
        fwd_transient_bytes=fwd,
        unsaved_fwd_transient_bytes=fwd + gathered,
        bwd_transient_bytes=8 * max(q.numel, k.numel) if low else 0,
        fwd_bytes_moved=3 * (q.n_bytes + k.n_bytes) + 8 * (q.numel + k.numel),
        bwd_bytes_moved=3 * (q.n_bytes + k.n_bytes) + 8 * (q.numel + k.numel),
        fwd_kernels=7,
        bwd_kernels=6,
    )


@register_variant(OpKind.ROPE_TABLES, OpVariant.SCALED_TABLES)
def hf_rope_tables_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """transformers 5.24.0 ``LlamaRotaryEmbedding.forward`` (modeling_llama.py): cos and sin of
    ``cat((freqs, freqs))`` times ``attention_scaling`` (two more (T, H) fp32 products), cast to
    the residual stream's dtype, shared by every layer for the whole forward (T H-sized: the
    reference formula plus those products)."""
    cost = rope_tables_cost(spec, ctx)
    th = ctx.seq_len * spec.head_dim
    return cost.model_copy(update={"fwd_transient_bytes": cost.fwd_transient_bytes + 2 * th * 4})


@register_variant(OpKind.CROSS_ENTROPY, OpVariant.SHIFTED_LABELS)
def shifted_cross_entropy_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """transformers 5.24.0 ``ForCausalLMLoss`` (loss/loss_utils.py)::

        logits = logits.float()
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
        loss = nn.functional.cross_entropy(logits.view(-1, V), shift_labels.view(-1), ignore_index=-100)

    The reference cross-entropy (the fp32 upcast is the graph's ``logits_cast``), plus the padded
    labels (B (T + 1) int64, a local until the loss returns) and the shifted copy (B T int64)
    that ``nll_loss`` saves as its target."""
    cost = cross_entropy_cost(spec, ctx)
    labels = ctx.tokens * 8
    padded = (ctx.tokens + ctx.batch) * 8
    return cost.model_copy(update={"saved_extra_bytes": (*cost.saved_extra_bytes, labels),
                                   "fwd_transient_bytes": cost.fwd_transient_bytes + padded})


@register_variant(OpKind.ATTENTION_EAGER, OpVariant.EAGER_MASK_ADDED, OpVariant.EAGER_FP32_SOFTMAX)
def hf_eager_attention_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """transformers 5.24.0 ``eager_attention_forward`` (modeling_llama.py; modeling_gpt2.py alike)::

        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()

    The reference eager core's allocations (``repeat_kv`` copies k and v for GQA as the
    reference's ``repeat`` does; the mask is added instead of filled in, one T x T tensor
    either way), but the add saves nothing, so the shared mask is not kept for backward.
    Llama, Mistral and Qwen2 ask for an fp32 softmax (``EAGER_FP32_SOFTMAX``): with bf16 scores
    (bf16-true) it runs as under autocast, an fp32 copy in, the fp32 probabilities saved and a
    bf16 copy for the second matmul; GPT-2's softmax takes the scores' dtype (CUDA autocast's
    fp32 list under bf16-mixed, as the reference)."""
    q = ctx.inputs[0]
    if spec.variant is OpVariant.EAGER_FP32_SOFTMAX and q.dtype is not _FP32 and ctx.precision.autocast_dtype is None:
        ctx = ctx.model_copy(update={"precision": ctx.precision.model_copy(update={"autocast_dtype": q.dtype})})
    cost = eager_attention_cost(spec, ctx)
    saves = cost.saves_inputs[:-1] + (False,)
    return cost.model_copy(update={"saves_inputs": saves})


@register_variant(OpKind.CAUSAL_MASK, OpVariant.FLOAT_MASK)
def float_mask_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """transformers 5.24.0 ``eager_mask`` (masking_utils.py): the causal pattern as a bool
    (1, 1, T, T) broadcast over the batch, turned into ``torch.where(mask, 0, finfo.min)`` of
    shape (B, 1, T, T) in the embeddings' dtype (the parameters'), built once per forward and
    shared by every layer (the ``causal_mask`` local of ``*Model.forward``)."""
    t2 = ctx.seq_len * ctx.seq_len
    dtype = ctx.precision.param_dtype
    return LayerCost(
        output=TensorInfo(numel=ctx.batch * t2, dtype=dtype, requires_grad=False),
        fwd_transient_bytes=2 * t2,
        fwd_bytes_moved=ctx.batch * t2 * dtype.n_bytes + 2 * t2,
        fwd_kernels=4,
        has_backward=False,
    )
