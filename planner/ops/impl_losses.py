"""Losses that never hold the whole (B, T, V) logits: torchtitan's chunked loss, Liger's fused
linear cross-entropy. Each takes the final norm's output (B, T, D) and owns the LM head weight.

Both compute the LM head's gradients inside their forward. The walk allocates an op's parameter
and input gradients at its backward, which follows the loss's forward directly, so these
formulas put what exists only during the forward into ``fwd_transient_bytes`` and leave the
gradients to the walk (the input gradient the walk allocates is the tensor the loss saved).

Notation: B micro-batch, T seq_len, D d_model, V vocab; h the hidden states (dtype bytes dh), W
the LM head weight (V x D, parameter dtype), Rc the rows of one chunk.
"""

from __future__ import annotations

import math

from hardware.dtypes import DType
from hardware.kernels import GemmShape
from planner.ops.base import AllocSequence, LayerCost, LayerSpec, OpContext, OpKind, OpVariant, TensorInfo, linear_flops
from planner.ops.registry import register_variant

TORCHTITAN_LOSS_CHUNKS = 8  # torchtitan 0.3.0 ChunkedLossWrapper.Config.num_chunks


def _matmul_costs(spec: LayerSpec, ctx: OpContext, rows: int) -> dict[str, object]:
    """The LM head's three matmuls (logits, input and weight gradients): FLOPs as FlopCounterMode
    counts them wherever they run, the GEMM shape of one chunk for the time model."""
    d, v = spec.in_features, spec.out_features
    flops = linear_flops(ctx.tokens, d, v)
    return dict(fwd_flops=flops, bwd_input_flops=flops, bwd_weight_flops=flops, matmul=True,
                gemm=GemmShape(m=rows, n=v, k=d), param_numel=d * v if spec.owns_params else 0,
                param_dtype=ctx.precision.param_dtype)


@register_variant(OpKind.CROSS_ENTROPY, OpVariant.CHUNKED_LOSS)
def chunked_loss_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """torchtitan 0.3.0 ``ChunkedLossWrapper`` (torchtitan/components/loss.py) around its
    ``CrossEntropyLoss`` (sum over tokens / global valid tokens), N chunks (``spec.chunks``):

    - ``h`` is split along the sequence and each chunk made ``.contiguous()`` (a copy for
      B > 1: B T D dh bytes in all; views for B = 1 or one chunk), detached as a leaf; the labels and the
      positions (``loss_inputs``) likewise;
    - ``GradAccumulator`` allocates ``zeros_like(h, float32)`` (4 B T D);
    - per chunk: ``logits = lm_head(chunk)`` (Rc V in the matmul dtype; the local keeps the
      previous chunk's logits until the new ones exist), ``cross_entropy(pred.float(), ...)``
      (an fp32 copy unless fp32, and the saved log-softmax, 4 Rc V), then ``backward()``: the
      nll and log-softmax gradients (4 Rc V each), cast to the matmul dtype, the LM head's input
      gradient and weight gradient (V D; under autocast cast to fp32), accumulated into
      ``lm_head.weight.grad``, and the chunk's input gradient copied into the buffer;
    - the buffer cast to h's dtype (a copy unless fp32) is saved by
      ``_DecoderOutputGradientBackProp`` and returned as h's gradient in the real backward.

    The weight gradient is allocated by the first chunk; the walk allocates it at this op's
    backward, so it is counted in the forward's transient (exact without accumulation; with
    accumulation the later micro-batches already hold it and this reads one gradient over).
    Under autocast the LM head's weight cast is cached for the forward (an autocast copy), and
    so is each chunk's cast (a detached leaf that requires grad): all N are held at the last.
    """
    h = ctx.inputs[0]
    b, t = ctx.batch, ctx.seq_len
    n = spec.chunks or TORCHTITAN_LOSS_CHUNKS
    d, v = spec.in_features, spec.out_features
    rows = b * math.ceil(t / n)
    low = ctx.precision.autocast_dtype
    dh = h.dtype.n_bytes
    dm = (low or h.dtype).n_bytes
    logits, fp32_rows = rows * v * dm, rows * v * 4
    seq = AllocSequence()
    if b > 1 and n > 1:  # contiguous chunks of h, the labels and the positions (one chunk: views)
        seq.alloc(h.n_bytes).alloc(ctx.tokens * 8).alloc(ctx.tokens * 8)
    seq.alloc(4 * h.numel).alloc(512)  # the fp32 gradient buffer, total_loss
    for chunk in range(min(n, 2)):  # the second chunk repeats for every later one
        if low is not None:  # autocast's copy of the chunk, saved by the matmul; the chunk is a leaf that
            # requires grad, so autocast caches the copy until it exits: the last chunk finds all n held
            seq.alloc(rows * d * low.n_bytes * (n - 1 if chunk else 1))
        seq.alloc(logits)
        if chunk:
            seq.free(logits)  # the previous chunk's logits: the local is rebound
        if dm != 4:
            seq.alloc(fp32_rows)  # pred.float()
        seq.alloc(fp32_rows)  # log_softmax's output, saved
        if dm != 4:
            seq.free(fp32_rows)
        seq.alloc(fp32_rows).alloc(fp32_rows).free(fp32_rows).free(fp32_rows)  # nll and log-softmax grads
        if dm != 4:
            seq.alloc(rows * v * dm).free(fp32_rows)  # cast back to the matmul dtype
        seq.alloc(rows * d * dm).alloc(v * d * dm).free(rows * v * dm)  # input and weight gradients
        if low is not None:
            seq.alloc(rows * d * 4).free(rows * d * dm)  # input grad to fp32
            seq.alloc(v * d * 4).free(v * d * dm)  # weight grad to fp32
        if chunk:  # added into .grad in place; the first chunk's becomes the .grad (grad-sized)
            seq.free(v * d * (4 if low is not None else dm))
        chunk_grad = rows * d * (4 if low is not None else dm)
        if chunk_grad != rows * d * 4:
            seq.alloc(rows * d * 4).free(rows * d * 4)  # .to(float32) into the buffer
        seq.free(chunk_grad)
    if dh != 4:
        seq.alloc(h.n_bytes)  # accumulated_grad = buffer.to(h.dtype)
    return LayerCost(
        output=TensorInfo(numel=1, dtype=DType.FP32),
        autocast_copy_bytes=(v * d * low.n_bytes,) if low is not None else (),
        fwd_transient_bytes=seq.peak,
        fwd_bytes_moved=(3 * ctx.tokens * v * (dm + 4 * 3)) + 4 * h.n_bytes + n * v * d * (dm + ctx.precision.grad_dtype.n_bytes),
        fwd_kernels=12 * n,
        bwd_kernels=0,
        **_matmul_costs(spec, ctx, rows),  # type: ignore[arg-type]
    )


def liger_chunk_rows(tokens: int, d_model: int, vocab: int) -> int:
    """Liger-Kernel 0.8.5 ``fused_linear_cross_entropy_forward``: ``inc_factor = cdiv(V, H)``,
    ``chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT)`` rows per chunk (about B T H
    logits elements at a time)."""
    inc = -(-vocab // d_model)
    rows = -(-tokens // inc)
    return min(1 << (rows - 1).bit_length(), tokens)


@register_variant(OpKind.CROSS_ENTROPY, OpVariant.FUSED_LINEAR_LOSS)
def fused_linear_loss_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Liger-Kernel 0.8.5 ``LigerFusedLinearCrossEntropyFunction`` (liger_kernel/ops/
    fused_linear_cross_entropy.py) as transformers models call it (``LigerForCausalLMLoss``:
    labels padded and shifted, h viewed as (B T, D)). Its forward allocates ``grad_input =
    zeros_like(h)`` and ``grad_weight = zeros_like(W)``, a (B T) fp32 loss, and walks chunks of
    Rc rows (``liger_chunk_rows``): logits (Rc V) overwritten in place by their gradient, then
    ``grad_input[rows] = grad @ W`` and ``grad_weight += grad^T @ h_rows``; both gradients are
    saved and returned in the backward (h's gradient and, stolen by AccumulateGrad, the .grad).
    On CUDA: bf16 with bf16 weights writes into one reused (Rc, V) buffer with ``mm(out=)`` and
    accumulates ``addmm(out=grad_weight)``; fp32 does too but adds ``mm(grad^T, h_rows)``
    (V D fp32) into the fp32 accumulator; under autocast ``h_rows @ W.t()`` casts W and the
    chunk to bf16 each time (``weight.t()`` is a view, so autocast does not cache it), while
    ``grad @ W`` casts the parameter itself, a leaf that autocast caches until it exits: from the
    first chunk on one bf16 W is held (beside the next chunk's uncached cast)."""
    h = ctx.inputs[0]
    d, v = spec.in_features, spec.out_features
    tokens = ctx.tokens
    rows = liger_chunk_rows(tokens, d, v)
    low = ctx.precision.autocast_dtype
    param = ctx.precision.param_dtype.n_bytes
    seq = AllocSequence().alloc(tokens * 8 * 2 + ctx.batch * 8)  # padded and shifted labels
    seq.alloc(h.n_bytes).alloc(v * d * param).alloc(tokens * 4).alloc(tokens)  # grads, loss_1d, target mask
    if low is None:
        seq.alloc(rows * v * h.dtype.n_bytes)  # the reused logits buffer
        if h.dtype is DType.FP32:
            seq.alloc(v * d * 4).free(v * d * 4)  # mm(grad^T, h_rows) added into grad_weight
    else:
        lo = low.n_bytes
        seq.alloc(rows * d * lo).alloc(v * d * lo).alloc(rows * v * lo).free(v * d * lo).free(rows * d * lo)
        seq.alloc(v * d * lo).alloc(rows * d * lo).free(rows * d * lo)  # grad @ W: W's cast cached
        seq.alloc(rows * d * lo).free(rows * d * lo).free(rows * v * lo)  # h_rows to bf16, addmm
        if tokens > rows:  # the next chunk's h_rows @ W.t() beside the cached W
            later = min(rows, tokens - rows)
            seq.alloc(later * d * lo).alloc(v * d * lo).alloc(later * v * lo)
    return LayerCost(
        output=TensorInfo(numel=1, dtype=DType.FP32),
        fwd_transient_bytes=seq.peak,
        fwd_bytes_moved=3 * tokens * v * (low or h.dtype).n_bytes + 3 * v * d * param + 3 * h.n_bytes,
        fwd_kernels=4 * -(-tokens // rows),
        bwd_kernels=2,
        **_matmul_costs(spec, ctx, rows),  # type: ignore[arg-type]
    )
