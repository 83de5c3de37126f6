"""Attention: the attention core (fused SDPA "flash", eager, or a ring under context parallelism);
rotary embedding is ``planner.ops.rotary``.

FLOPs follow FlopCounterMode's SDPA formulas (torch/utils/flop_counter.py ``sdpa_flop_count``):
forward = QK^T + PV = 2 * (2*B*N*T*T*H), the full T x T square (no causal discount);
backward = 2 x forward. The executed FLOPs (for time) differ: a causal flash kernel skips the
masked half, and its backward recomputes QK^T (5 matmuls instead of 4; Dao 2023, FlashAttention-2).
"""

from __future__ import annotations

from typing import NamedTuple

from hardware.collectives import Collective
from hardware.dtypes import DType
from hardware.kernels import AttentionShape
from planner.errors import ConfigError
from planner.ops.base import AllocSequence, CollectiveCall, LayerCost, LayerSpec, MeshDim, OpContext, OpKind, TensorInfo
from planner.ops.elementwise import promote
from planner.ops.gemma import softcap_forward
from planner.ops.registry import register


def _attention_flops(spec: LayerSpec, ctx: OpContext) -> float:
    """QK^T over the query/key head dim H and PV over the value head dim V (H unless MLA sets
    ``v_head_dim``): 2*B*N*T^2*(H + V), 4*B*N*T^2*H when they are equal."""
    return 2.0 * ctx.batch * spec.n_heads * ctx.seq_len * ctx.seq_len * (spec.head_dim + _v_dim(spec))


def _v_dim(spec: LayerSpec) -> int:
    """The value heads' size: ``v_head_dim`` where set (MLA), else the query/key head dim."""
    return spec.v_head_dim or spec.head_dim


def _refuse_binding_window(spec: LayerSpec, seq_len: int) -> None:
    """SDPA runs ``is_causal`` with no window: exact only while the window masks nothing (T <= W;
    ``ModelConfig.window_refusal`` says so at resolve time, this guards direct callers)."""
    if spec.window and spec.window < seq_len:
        raise ConfigError(f"sliding_window: {spec.window} keys per query is below seq_len {seq_len}, and flash "
                          "attention (SDPA, is_causal) takes no window; use attention: eager or a seq_len of at most "
                          f"{spec.window}")


@register(OpKind.ATTENTION_FLASH)
def flash_attention_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Fused SDPA (FlashAttention-2 on CUDA, its CPU port on CPU), causal, GQA handled natively.

    Saves q, k, v, the output (B, N, T, H) and a (B, N, T) fp32 log-sum-exp; never the T x T
    scores (Korthikanti's 5as/h term disappears). The output is laid out (B, T, N, H), so the
    merge of heads before ``o_proj`` is a view. Backward keeps an fp32 dq accumulator
    (B, T, N, H) and, with GQA, expanded dk/dv of N heads before they are summed to K.

    Where the value head dim V differs from the query/key one H (MLA: H = nope + rope), FlashAttention
    cannot run and SDPA takes the memory-efficient kernel (xFormers' cutlass kernel in
    aten/src/ATen/native/transformers/cuda/attention.cu): it saves q, k, v, the output (B, N, T, V),
    again laid out (B, T, N, V), and an fp32 log-sum-exp padded to a multiple of 32 rows
    (B, N, ceil(T/32) 32); its backward writes dq, dk and dv directly (torch 2.13's fake kernel
    allocates nothing else; the CUDA kernel's workspace is not modelled).
    """
    _refuse_binding_window(spec, ctx.seq_len)
    dtype = promote(*(t.dtype for t in ctx.inputs))
    bnt = ctx.batch * spec.n_heads * ctx.seq_len
    efficient = _v_dim(spec) != spec.head_dim
    out = TensorInfo(numel=bnt * _v_dim(spec), dtype=dtype)
    flops = _attention_flops(spec, ctx)
    io_bytes = sum(t.n_bytes for t in ctx.inputs) + out.n_bytes
    lse = ctx.batch * spec.n_heads * -(-ctx.seq_len // 32) * 32 * 4 if efficient else bnt * 4
    bwd_transient = 0 if efficient else out.numel * 4 + bnt * 4
    if spec.n_kv_heads < spec.n_heads:
        bwd_transient += 2 * out.n_bytes
    return LayerCost(
        fwd_flops=flops,
        bwd_input_flops=2 * flops,
        exec_fwd_flops=flops / 2,
        exec_bwd_flops=2.5 * flops / 2,
        attention=AttentionShape(seq_len=ctx.seq_len, head_dim=spec.head_dim, causal=True, fused=True,
                                 kernel=spec.attention_kernel),
        fwd_bytes_moved=io_bytes + lse,
        bwd_bytes_moved=2 * io_bytes + out.n_bytes + 2 * lse,
        fwd_kernels=1,
        bwd_kernels=3,
        matmul=True,
        output=out,
        saves_inputs=tuple(True for _ in ctx.inputs),
        saves_output=True,
        saved_extra_bytes=(lse,),
        extras_are_outputs=True,  # the log-sum-exp: the kernel's second output
        bwd_transient_bytes=bwd_transient,
    )


class _EagerSizes(NamedTuple):
    """Bytes of the eager core's tensors: ``operand`` a (B*N, T, H) q/k/v copy, ``scores`` the
    element count of a T x T square (B*N*T*T, also the bool mask's bytes), ``s_bytes`` the square
    in the operands' dtype, ``cat_bytes`` the sink-widened scores (0 without sinks), ``p_bytes``
    the softmax's output (fp32 under autocast, T + 1 wide with sinks)."""

    operand: int
    scores: int
    s_bytes: int
    cat_bytes: int
    p_bytes: int
    sinks: bool
    autocast: bool
    dropout: bool
    softcap: bool = False


def _eager_forward(z: _EagerSizes) -> tuple[AllocSequence, list[int]]:
    """The eager core's forward allocations when it saves for backward, and the saved extras in order
    (q and k copies, softmax output, dropout's mask and dropped probs or the low-precision probs, v copy)."""
    operand, s_bytes, p_bytes = z.operand, z.s_bytes, z.p_bytes
    extras = [operand, operand]  # q and k operand copies
    seq = AllocSequence().alloc(2 * operand).alloc(s_bytes).alloc(s_bytes).free(s_bytes)  # q k^T, * s
    if z.softcap:  # Gemma 2: c * tanh(s / c) (planner.ops.gemma), tanh's output saved
        softcap_forward(seq, s_bytes, saved=True)
        extras.append(s_bytes)
    seq.alloc(s_bytes).free(s_bytes)  # masked_fill
    logits = s_bytes
    if z.sinks:
        seq.alloc(z.cat_bytes).free(s_bytes)  # the sink column joined; the masked scores die
        logits = z.cat_bytes
    if z.autocast:
        # softmax(dtype=fp32) on bf16 copies the scores to fp32 first (ATen fuses the cast only
        # for CUDA fp16), then the masked scores and the copy die
        seq.alloc(p_bytes).alloc(p_bytes).free(p_bytes).free(logits)
        seq.alloc(s_bytes)  # low-precision copy of the probs
        extras.append(p_bytes)  # softmax saves its fp32 output
    else:
        seq.alloc(p_bytes).free(logits)  # softmax output
        extras.append(p_bytes)  # saved by softmax (and by the matmul when there is no dropout)
    if z.dropout:
        seq.alloc(z.scores).alloc(s_bytes)  # bool mask, dropped probabilities (saved by the matmul)
        extras += [z.scores, s_bytes]
        if z.autocast:
            seq.free(s_bytes)  # the low-precision probs: only dropout read them
    elif z.autocast:
        extras.append(s_bytes)  # the matmul saves the low-precision probs
    seq.alloc(operand).alloc(operand).alloc(operand)  # v copy (saved), p v, head merge copy
    extras.append(operand)
    return seq, extras


def _eager_unsaved_forward(z: _EagerSizes, out_bytes: int) -> AllocSequence:
    """The eager core's forward inside a checkpointed block: nothing is saved, each internal tensor
    dies with its last use."""
    operand, s_bytes, p_bytes = z.operand, z.s_bytes, z.p_bytes
    probs_in = s_bytes if z.autocast else p_bytes  # the storage the second matmul (or dropout) reads
    logits = z.cat_bytes if z.sinks else s_bytes
    bare = AllocSequence().alloc(2 * operand).alloc(s_bytes).free(2 * operand)  # q k^T; copies die
    bare.alloc(s_bytes).free(s_bytes)  # * scale
    if z.softcap:
        softcap_forward(bare, s_bytes, saved=False)
    bare.alloc(s_bytes).free(s_bytes)  # masked_fill
    if z.sinks:
        bare.alloc(z.cat_bytes).free(s_bytes)
    if z.autocast:
        bare.alloc(p_bytes).alloc(p_bytes).free(p_bytes).free(logits).alloc(s_bytes).free(p_bytes)
    else:
        bare.alloc(p_bytes).free(logits)  # softmax
    if z.dropout:
        bare.alloc(z.scores).alloc(s_bytes).free(z.scores).free(probs_in)  # mask dies; the input probs die
        probs_in = s_bytes
    bare.alloc(operand).alloc(operand).free(operand + probs_in).alloc(out_bytes).free(operand)  # v, p v, merge
    return bare


@register(OpKind.ATTENTION_EAGER)
def eager_attention_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``softmax(mask(q k^T * s)) v`` written out (Korthikanti et al. 2022, Table 2 setting).

    ``matmul`` folds (B, N) into a bmm batch, copying q, k and v into contiguous (B*N, T, H)
    operands (they are strided views of the projections) and saving the copies: 3 x B*N*T*H.
    Saved T x T tensors: the softmax output and, with dropout, its bool mask and the dropped
    probabilities (Korthikanti's 5as^2b bytes in 16-bit). Under autocast softmax runs in fp32
    (CUDA autocast's fp32 list; the reference model asks for it explicitly so CPU agrees) and
    the probabilities are cast back for the second matmul: fp32 probs + a low-precision copy saved.
    The heads are merged with a copy (B, T, N*H), saved by ``o_proj``. The shared causal mask is
    saved by ``masked_fill``.

    A sliding window (``spec.window``) changes nothing here: the reference model (as transformers'
    eager path) computes the full T x T square and masks it with the window mask it takes (the
    sliding layers' shared mask). A windowed kernel (FlashAttention-2's ``window_size``, flex
    attention's block mask) would skip the blocks outside the window: about 4 B N H T W executed
    forward FLOPs instead of 4 B N H T^2 / 2 (causal), and no T x T tensor at all.

    Attention sinks (``spec.sinks``, gpt-oss): ``cat`` puts the head's sink logit beside every row
    (a (B, N, T, T+1) copy of the masked scores, which then die), the softmax runs over T + 1
    columns (its saved output is T + 1 wide) and its last column is sliced off (a view; under
    autocast the low-precision copy is T wide). FLOPs are unchanged (FlopCounterMode counts the
    two matmuls).

    Soft-capped scores (``spec.softcap``, Gemma 2's ``attn_logit_softcapping``; transformers
    5.24.0 ``models/gemma2/modeling_gemma2.py`` ``eager_attention_forward``: ``s / c``, ``tanh``,
    ``* c`` after the scaling, before the mask): three more (B, N, T, T) tensors of the scores'
    dtype, each freeing the one before; tanh's output is saved (``tanh_backward`` reads the
    result; division and product by a Python float save only the scalar), one more T x T tensor
    held to the backward (``planner.ops.gemma.softcap_forward``). Its backward (grad * c,
    ``tanh_backward``, / c) runs after the softmax's, when the probabilities are gone: no new
    peak. No FLOPs.
    """
    *qkv, _mask = ctx.inputs  # the shared causal (or window) mask: saved, owned by its producer
    dtype = promote(*(t.dtype for t in qkv))
    n, h = spec.n_heads, spec.head_dim
    bnt = ctx.batch * n * ctx.seq_len
    operand = bnt * h * dtype.n_bytes
    scores = bnt * ctx.seq_len
    cols = ctx.seq_len + (1 if spec.sinks else 0)  # the softmax's columns
    s_bytes = scores * dtype.n_bytes
    cat_bytes = bnt * cols * dtype.n_bytes if spec.sinks else 0
    low = ctx.precision.autocast_dtype
    p_dtype = DType.FP32 if low is not None else dtype
    p_bytes = bnt * cols * p_dtype.n_bytes  # softmax's output
    drop = spec.dropout > 0
    sizes = _EagerSizes(operand, scores, s_bytes, cat_bytes, p_bytes, spec.sinks, low is not None, drop, spec.softcap)
    capped = 3 if spec.softcap else 0  # Gemma 2's soft-capping: three elementwise kernels each way
    seq, extras = _eager_forward(sizes)
    out = TensorInfo(numel=bnt * h, dtype=dtype)
    final = sum(extras) + out.n_bytes
    flops = _attention_flops(spec, ctx)
    io_bytes = sum(t.n_bytes for t in qkv) + out.n_bytes
    n_tt = 3 if drop else 1
    return LayerCost(
        fwd_flops=flops,
        bwd_input_flops=2 * flops,
        # the full square is computed, then masked: priced with the math path's non-causal rates
        attention=AttentionShape(seq_len=ctx.seq_len, head_dim=spec.head_dim, causal=False, fused=False),
        fwd_bytes_moved=io_bytes + 4 * operand + (4 + 2 * n_tt + 2 * capped) * s_bytes + 2 * cat_bytes,
        bwd_bytes_moved=2 * io_bytes + 4 * operand + (6 + 2 * n_tt + 7 * capped // 3) * s_bytes + 2 * cat_bytes,
        fwd_kernels=8 + (1 if drop else 0) + (1 if spec.sinks else 0) + capped,
        bwd_kernels=10 + (1 if drop else 0) + (2 if spec.sinks else 0) + capped,
        matmul=True,
        output=out,
        saves_inputs=tuple(False for _ in qkv) + (True,),
        saved_extra_bytes=tuple(extras),
        # a recompute that ends here (the core checkpointed alone) stops before p @ v: the matmul
        # packs its inputs, the last thing saved, before its kernel runs
        unrun_tail_flops=flops / 2,
        fwd_transient_bytes=seq.transient_over(final),
        unsaved_fwd_transient_bytes=_eager_unsaved_forward(sizes, out.n_bytes).transient_over(out.n_bytes),
        bwd_transient_bytes=max(0, _eager_backward_peak(operand, s_bytes, p_bytes, scores, drop, low is not None,
                                                        bnt * cols * dtype.n_bytes) - sum(t.n_bytes for t in qkv)),
    )


def _eager_backward_peak(operand: int, s_bytes: int, p_bytes: int, mask_bytes: int, dropout: bool,
                         autocast: bool, g_bytes: int) -> int:
    """The eager core's backward peak above what exists when it starts (its saved tensors and the
    output gradient), input gradients included. First the head merge's gradient made contiguous,
    dv and the probabilities' gradient (2 x operand + s). Then autograd frees each node's saved
    tensors behind it (v's copy, the incoming gradient, and with dropout the dropped
    probabilities, then the bool mask and the probabilities' gradient once dropout's backward
    has run), and the softmax's backward allocates its gradient beside its saved output (p) and
    the gradient reaching it: in fp32 under autocast (a copy of the low-precision one, which dies
    first), else as is. Read op by op from the live-storage tracker over the reference model
    (GPT-2 shapes, fp32, bf16 autocast, bf16, with and without dropout). With attention sinks the
    gradient reaching the softmax (``g_bytes``) is ``slice_backward``'s T + 1 columns wide (read
    from the tracker the same way: fp32 and bf16, with and without dropout, MHA)."""
    first = 2 * operand + s_bytes
    if autocast:  # ... dv, the fp32 gradient and its softmax gradient; the bf16 one is gone
        second = 2 * p_bytes - s_bytes - operand - (mask_bytes if dropout else 0)
    else:  # ... dv, the gradient reaching softmax (g bytes) and softmax's gradient
        second = g_bytes + p_bytes - operand - (mask_bytes if dropout else 0)
    return max(first, second)


def _ring_peaks(u: int, w: int, lse: int, cp: int, low_precision: bool) -> tuple[int, int]:
    """(forward, backward) peak bytes inside torch's ring attention on rank 0 of ``cp``, above
    what exists when it starts (its inputs, and in the backward the output gradient): ``u`` the
    local queries/output, ``w`` the local keys (values alike), ``lse`` the fp32 log-sum-exp, all
    in bytes; ``u4``/``w4`` their fp32 accumulators. Transcribed from torch 2.13's
    ``_templated_ring_attention`` (``_RotateMethod.ALL_GATHER``) and its backward, rank 0 (every
    step after the first is its "partial" one: the second half of its queries against the whole
    key/value shard), and matched to the byte with the live-storage tracker on 144 shapes (cp 2, 4
    and 8; fp32 and bf16; MHA and GQA 2 and 4; tests/planner/test_context_parallel.py keeps a grid).

    Forward: contiguous copies of k and v (2w), their concatenation (2w) and the all-gathered
    shards (2 cp w); the first block's output and lse (u + lse, and an fp32 copy of the output
    under mixed precision) while, from the second step on (cp > 2), the next concatenation (2w)
    exists; then each partial step's merge in fp32: the running output, the block's half, the
    merged half and the concatenation that replaces the running output (3 u4, plus the block's
    low-precision half), with two lse-sized tensors.

    Backward: fp32 accumulators for dq, dk, dv (u4 + 2 w4), the concatenation (2w) and the gathered
    shards (2 cp w) for the whole loop; at the second step the first step's gradients (u + 2w)
    and the new partial ones (u/2 + 2w), the dk/dv concatenation and its all-to-all result
    (2 x 2 w4), half an lse; from the third step (cp > 2) one more concatenation of k and v
    before the call; at each partial step's update of dq (a concatenation) two dq accumulators
    and three dk/dv buffers (the received one still viewed by dk, dv)."""
    u4, w4 = u * 4 // (2 if low_precision else 4), w * 4 // (2 if low_precision else 4)
    gathered = 2 * cp * w
    first = 2 * w + 2 * w + gathered  # copies, concatenation, gathered shards
    block0 = 2 * w + gathered + u + lse + (u4 if low_precision else 0) + (2 * w if cp > 2 else 0)
    merge = gathered + 3 * u4 + (u // 2 if low_precision else 0) + 2 * lse
    forward = max(first, block0, merge)
    second = u4 + 2 * w4 + 2 * w + gathered + (u + 2 * w) + 2 * (2 * w4) + lse // 2 + (u // 2 + 2 * w)
    third = second + 2 * w - u // 2 - lse // 2 if cp > 2 else 0
    update = 2 * u4 + 3 * (2 * w4) + gathered + 2 * w + (u // 2 + 2 * w) + lse // 2
    return forward, max(second, third, update)


def _ring_collectives(
    spec: LayerSpec, w: int, w4: int
) -> tuple[tuple[CollectiveCall, ...], tuple[CollectiveCall, ...]]:
    """(forward, backward) collectives of ring attention over ``spec.group_size`` = cp ranks, ``w``
    the local keys' bytes (values alike), ``w4`` their fp32 size: the k/v all-gather, hidden behind
    1/cp of the kernel, in each pass; in the backward the fp32 dk/dv permutes, cp - 1 of them hidden
    by the next block and the last waited for."""
    cp = spec.group_size

    def call(kind: Collective, n_bytes: float, overlap: float, calls: int = 1) -> CollectiveCall:
        return CollectiveCall(kind=kind, n_bytes=n_bytes, group_size=cp, ranks_per_node=spec.ranks_per_node,
                              dimension=MeshDim.CP, overlap=overlap, calls=calls)

    gather = call(Collective.ALL_GATHER, 2 * cp * w, 1 / cp)
    return (gather,), (gather, call(Collective.PERMUTE, cp * 2 * w4, 1 / cp, cp - 1),
                       call(Collective.PERMUTE, cp * 2 * w4, 0.0))


@register(OpKind.ATTENTION_RING)
def ring_attention_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """SDPA under context parallelism (torch's ``context_parallel``, as torchtitan runs it): this
    rank holds T/cp tokens of every sequence, two chunks of 2 cp (head-tail load balancing), and
    attends them to every rank's keys and values (``group_size`` = cp ranks).

    Each rank runs cp flash calls: its causal diagonal block (T/cp)^2 and cp - 1 non-causal blocks
    of (T/2cp) x (T/cp) (ranks past it: its later half of queries; with load balancing every rank
    runs the same), merging outputs by log-sum-exp in fp32. Executed FLOPs
    ``4 B N H (T/cp)^2 cp / 2`` per rank (1/cp of the causal work), backward 2.5 x; model FLOPs
    are the rank's 1/cp share of the unsharded model's as FlopCounterMode counts it (the full
    T x T square: ``4 B N H T^2 / cp``), so MFU compares across layouts.

    Memory (rank 0, the rank with the most): SDPA saves q, k, v, its merged output (B, N, T/cp, H)
    and the fp32 lse; the merged output is concatenated in (B, N, T, H) order, so the head merge
    before ``o_proj`` is a copy (the op's output, saved by ``o_proj``). Transients: ``_ring_peaks``.

    Communication (``_RotateMethod.ALL_GATHER``, torch's default): the forward all-gathers k and v
    once (issued before the diagonal block, waited before the second: it hides behind 1/cp of the
    kernel time); the backward all-gathers them again the same way and passes the fp32 dk/dv
    round the ring with a permute after every block (each hidden by the next block, the last one
    waited for)."""
    *qk, v = ctx.inputs
    _refuse_binding_window(spec, ctx.seq_len * spec.group_size)  # the rank holds T/cp tokens
    dtype = promote(*(t.dtype for t in ctx.inputs))
    cp, b = spec.group_size, dtype.n_bytes
    bnt = ctx.batch * spec.n_heads * ctx.seq_len
    u = bnt * spec.head_dim * b
    w = ctx.batch * spec.n_kv_heads * ctx.seq_len * spec.head_dim * b
    lse = bnt * 4
    low = b < 4
    forward, backward = _ring_peaks(u, w, lse, cp, low)
    out = TensorInfo(numel=bnt * spec.head_dim, dtype=dtype)  # the heads merged: a copy
    square = 4.0 * ctx.batch * spec.n_heads * ctx.seq_len * ctx.seq_len * spec.head_dim
    executed = square * cp / 2  # the diagonal block's causal half + cp - 1 half blocks
    u4, w4 = bnt * spec.head_dim * 4, w * 4 // b
    io = u + 2 * w + u + lse
    fwd_collectives, bwd_collectives = _ring_collectives(spec, w, w4)
    return LayerCost(
        fwd_flops=square * cp,
        bwd_input_flops=2 * square * cp,
        exec_fwd_flops=executed,
        exec_bwd_flops=2.5 * executed,
        attention=AttentionShape(seq_len=ctx.seq_len, head_dim=spec.head_dim, causal=True, fused=True,
                                 kernel=spec.attention_kernel),
        ring_ranks=cp,
        fwd_collectives=fwd_collectives,
        bwd_collectives=bwd_collectives,
        # each step reads its queries and the gathered shard and writes a block; the merges stream fp32
        fwd_bytes_moved=cp * io + (cp - 1) * 5 * u4,
        bwd_bytes_moved=2 * cp * io + (cp - 1) * 6 * (u4 + 2 * w4),
        fwd_kernels=cp + 12 * (cp - 1) + 6,
        bwd_kernels=3 * cp + 10 * (cp - 1) + 8,
        matmul=True,
        output=out,
        saves_inputs=tuple(True for _ in ctx.inputs),
        saved_extra_bytes=(u, lse),
        extras_are_outputs=True,  # the SDPA call's merged output and log-sum-exp
        fwd_transient_bytes=max(0, forward - (2 * u + lse)),
        unsaved_fwd_transient_bytes=max(0, forward - u),
        bwd_transient_bytes=max(0, backward - (u + 2 * w)),
    )
