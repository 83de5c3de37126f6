"""Mixture-of-experts routing ops, as the reference MoE runs them (``validate.models.moe``).

Notation: N tokens of the micro-batch (on this rank), D d_model, E experts, k top_k, C rows per
expert (``MoeConfig.expert_rows``: N k / E balanced), R = E C expert rows. The experts' matmuls
are ``GROUPED_LINEAR`` (planner.ops.linear) and their SwiGLU the dense SiLU / product ops; the
router is a linear. None of these ops does matmul FLOPs (FlopCounterMode counts none: index ops
and elementwise products); their time is the bytes they move.
"""

from __future__ import annotations

from hardware.dtypes import DType
from planner.model.families.moe.config import MoeConfig, RouterScoring
from planner.ops.base import AllocSequence, LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register

_INDEX = DType.INT64.n_bytes
_F32 = DType.FP32.n_bytes


def _moe(spec: LayerSpec) -> MoeConfig:
    """The op's MoE configuration (every MoE op carries it)."""
    assert spec.moe is not None, f"{spec.name}: a mixture-of-experts op without its moe config"
    return spec.moe


@register(OpKind.MOE_SLOTS)
def moe_slots_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Which token each expert row holds: ``arange(N k).view(C, E).t().reshape(-1) // k``.

    The arange (8 N k bytes), its transposed copy (8 R) and the floor division (8 R, the output:
    int64, no gradient; dispatch and combine save it). The arange and the copy are transients.
    """
    moe = _moe(spec)
    n = ctx.tokens
    rows = moe.n_experts * moe.expert_rows(n)
    out = TensorInfo(numel=rows, dtype=DType.INT64, requires_grad=False)
    seq = AllocSequence().alloc(_INDEX * n * moe.top_k).alloc(_INDEX * rows).free(_INDEX * n * moe.top_k)
    seq.alloc(_INDEX * rows).free(_INDEX * rows)
    return LayerCost(output=out, fwd_transient_bytes=seq.transient_over(out.n_bytes),
                     fwd_bytes_moved=3 * _INDEX * rows, fwd_kernels=3, has_backward=False)


@register(OpKind.MOE_DISPATCH)
def moe_dispatch_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``x.reshape(N, D).index_select(0, slots)``: the expert rows (R, D), a copy of each token per
    choice. Saves the index (the slots); backward index_adds the rows' gradient into a zeroed
    (N, D) gradient of x (the input gradient itself)."""
    x, slots = ctx.inputs
    d = spec.in_features
    out = TensorInfo(numel=slots.numel * d, dtype=x.dtype)
    return LayerCost(output=out, saves_inputs=(False, True),
                     fwd_bytes_moved=2 * out.n_bytes + slots.n_bytes,
                     bwd_bytes_moved=2 * out.n_bytes + x.n_bytes + slots.n_bytes, bwd_kernels=2)


def _route_forward(
    moe: MoeConfig, n: int, fp32_logits: bool, row_index: int, out_bytes: int
) -> tuple[AllocSequence, list[int]]:
    """The softmax/sigmoid router's forward allocations over ``n`` tokens, and its saved extras in
    order (gather's index, the probabilities, div's operands, index_select's (R,) index)."""
    e, k = moe.n_experts, moe.top_k
    f32 = DType.FP32.n_bytes
    probs, chosen = f32 * n * e, f32 * n * k
    extras = [_INDEX * n * k, probs]  # gather's index, softmax's output
    seq = AllocSequence().alloc(_INDEX * n * k).alloc(_INDEX * n * k).free(_INDEX * n * k)
    if not fp32_logits:
        seq.alloc(probs).alloc(probs).free(probs)  # the fp32 copy, then the softmax
    else:
        seq.alloc(probs)
    if moe.aux_loss_coef:
        seq.alloc(f32 * e).alloc(f32).free(f32 * e).alloc(f32).free(2 * f32)  # mean, sum, times coef
    seq.alloc(chosen)
    if moe.norm_topk_prob:
        seq.alloc(f32 * n)  # sum
        if moe.scoring is RouterScoring.SIGMOID:
            seq.alloc(f32 * n).free(f32 * n)  # + 1e-20; the sum dies
        seq.alloc(chosen)  # quotient
        extras += [chosen, f32 * n]
    if moe.routed_scaling_factor != 1.0:
        seq.alloc(chosen).free(chosen)  # the product; the unscaled weights die unsaved
    seq.alloc(_INDEX * n * k).alloc(row_index).free(_INDEX * n * k)
    extras.append(row_index)
    seq.alloc(out_bytes).free(chosen)  # the rows' weights; the (N, k) weights die unsaved
    return seq, extras


def _route_backward(moe: MoeConfig, n: int, fp32_logits: bool) -> AllocSequence:
    """The softmax/sigmoid router's backward allocations: the weights' gradient scattered into (N k),
    div's gradients ((N, k) quotient, (N, k) product, (N, 1) sum), gather's (N, E), the softmax's
    fp32 gradient, cast back."""
    f32 = DType.FP32.n_bytes
    probs, chosen = f32 * n * moe.n_experts, f32 * n * moe.top_k
    back = AllocSequence().alloc(chosen)
    if moe.routed_scaling_factor != 1.0:
        back.alloc(chosen).free(chosen)
    if moe.norm_topk_prob:
        back.alloc(chosen).alloc(chosen).alloc(f32 * n).free(chosen).free(chosen)
    back.alloc(probs).free(chosen)
    if moe.aux_loss_coef:
        back.alloc(probs).free(probs)  # the mean's gradient, summed into the scattered one
    if not fp32_logits:
        back.alloc(probs)  # softmax's fp32 gradient beside the scattered one; then the cast (input grad)
    return back


@register(OpKind.MOE_ROUTE)
def moe_route_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Routing weights of the expert rows, fp32 (R,), from the router logits (N, E):
    ``softmax(logits, fp32)`` or, for DeepSeek-V3's router, ``sigmoid(logits.float())`` (a fp32
    copy of low-precision logits first; the scores are saved), ``gather`` of the k chosen experts
    (saves its int64 (N, k) index, built by an arange and a remainder), renormalized by their sum
    if ``norm_topk_prob`` (``div`` saves both operands: (N, k) and (N, 1); the sigmoid router adds
    1e-20 to the sum first, an (N, 1) temporary), times ``routed_scaling_factor`` unless it is 1
    (a new (N, k), nothing saved), then ``index_select`` into row order (saves its (R,) index,
    an arange's transposed copy). With ``aux_loss_coef`` the load-balancing loss reads the
    probabilities (``coef * probs.mean(0).sum()``: an (E,) mean and scalars, kept by no node).
    DeepSeek-V3's choice of experts (scores + e_score_correction_bias, group-limited top-k:
    indices only, no gradient, no FLOPs) is replaced by the fixed balanced routing, as the softmax
    routers' top-k is; its (N, E) temporaries are not modelled.

    Backward, per node: index_add into (N k), the scaling's product, div's two gradients,
    gather's scatter into a zeroed (N, E), the load-balancing loss's (N, E) gradient added to it,
    the softmax's (or sigmoid's) fp32 gradient, cast back to the logits' dtype.
    """
    moe = _moe(spec)
    if moe.scoring is RouterScoring.TOPK_SOFTMAX:
        return _topk_softmax_route(moe, ctx)
    if moe.scoring is RouterScoring.TOPK_SIGMOID:
        return _topk_sigmoid_route(moe, ctx)
    logits = ctx.inputs[0]
    e, k = moe.n_experts, moe.top_k
    n = logits.numel // e
    rows = e * moe.expert_rows(n)
    f32 = DType.FP32.n_bytes
    probs, chosen, row_index = f32 * n * e, f32 * n * k, _INDEX * rows
    out = TensorInfo(numel=rows, dtype=DType.FP32)
    fp32_logits = logits.dtype is DType.FP32
    seq, extras = _route_forward(moe, n, fp32_logits, row_index, out.n_bytes)
    back = _route_backward(moe, n, fp32_logits)
    scaled = moe.routed_scaling_factor != 1.0
    return LayerCost(
        output=out,
        saves_inputs=(False,),
        saved_extra_bytes=tuple(extras),
        fwd_transient_bytes=seq.transient_over(sum(extras) + out.n_bytes),
        bwd_transient_bytes=back.peak,
        fwd_bytes_moved=logits.n_bytes + 3 * probs + 6 * chosen + 3 * row_index + out.n_bytes,
        bwd_bytes_moved=2 * out.n_bytes + 6 * chosen + 4 * probs + logits.n_bytes,
        fwd_kernels=9 + (1 if scaled else 0), bwd_kernels=8 + (1 if scaled else 0),
    )


def _topk_softmax_route(moe: MoeConfig, ctx: OpContext) -> LayerCost:
    """gpt-oss's router (``GptOssTopKRouter``: top-k of the logits, softmax over those k): the k
    chosen logits gathered (N, k) (saves its int64 index, an arange's remainder), ``softmax`` over
    them in fp32 (a fp32 copy of low-precision logits first; saves its output), ``index_select``
    into row order (saves its (R,) index, an arange's transposed copy).

    Backward: index_add into (N k), softmax's fp32 gradient (cast back to the logits' dtype), the
    gather's scatter_add into a zeroed (N, E) (out of place: two (N, E) at once): the logits'
    gradient.
    """
    logits = ctx.inputs[0]
    e, k = moe.n_experts, moe.top_k
    n = logits.numel // e
    rows = e * moe.expert_rows(n)
    f32, low = DType.FP32.n_bytes, logits.dtype.n_bytes
    chosen, row_index = f32 * n * k, _INDEX * rows
    out = TensorInfo(numel=rows, dtype=DType.FP32)
    extras = [_INDEX * n * k, chosen, row_index]  # gather's index, softmax's output, index_select's index
    seq = AllocSequence().alloc(_INDEX * n * k).alloc(_INDEX * n * k).free(_INDEX * n * k)  # arange, remainder
    seq.alloc(low * n * k)  # the gathered logits
    if logits.dtype is not DType.FP32:
        seq.alloc(chosen).alloc(chosen).free(chosen)  # the fp32 copy, then the softmax
    else:
        seq.alloc(chosen)
    seq.free(low * n * k)
    seq.alloc(_INDEX * n * k).alloc(row_index).free(_INDEX * n * k)
    seq.alloc(out.n_bytes)
    # backward (read op by op from the tracker): index_select's zeros and index_add (2 chosen);
    # later, with its index released (and under autocast the fp32 gradient cast back), the
    # gather's zeros (N, E) and its out-of-place scatter_add beside it (the logits' gradient)
    cast_saving = chosen - low * n * k
    back_peak = max(2 * chosen, 2 * logits.n_bytes - row_index - cast_saving)
    return LayerCost(
        output=out,
        saves_inputs=(False,),
        saved_extra_bytes=tuple(extras),
        fwd_transient_bytes=seq.transient_over(sum(extras) + out.n_bytes),
        bwd_transient_bytes=max(0, back_peak - logits.n_bytes),
        fwd_bytes_moved=logits.n_bytes + 2 * low * n * k + 3 * chosen + 3 * row_index + out.n_bytes,
        bwd_bytes_moved=2 * out.n_bytes + 4 * chosen + 2 * logits.n_bytes,
        fwd_kernels=7, bwd_kernels=6,
    )


def _topk_sigmoid_route(moe: MoeConfig, ctx: OpContext) -> LayerCost:
    """Llama 4's router (transformers 5.24.0 ``Llama4Router``: the top-k logits, an fp32 sigmoid of
    each, cast back; the others score 0 and are not routed): the k chosen logits gathered (N, k)
    (saves its int64 index, an arange's remainder), ``sigmoid(chosen.float())`` (saves its fp32
    output; a low-precision copy first), cast back to the logits' dtype, ``index_select`` into row
    order (saves its (R,) index, an arange's transposed copy): (R,) weights in the logits' dtype.

    Backward: index_select's zeros and index_add (N k), the cast's fp32 gradient, sigmoid's, cast
    back, then gather's scatter into a zeroed (N, E) beside it (the logits' gradient).
    """
    logits = ctx.inputs[0]
    e, k = moe.n_experts, moe.top_k
    n = logits.numel // e
    rows = e * moe.expert_rows(n)
    low = logits.dtype is not DType.FP32
    chosen, f32_chosen, row_index = logits.dtype.n_bytes * n * k, _F32 * n * k, _INDEX * rows
    out = TensorInfo(numel=rows, dtype=logits.dtype)
    extras = [_INDEX * n * k, f32_chosen, row_index]  # gather's index, sigmoid's output, index_select's index
    seq = AllocSequence().alloc(_INDEX * n * k).alloc(_INDEX * n * k).free(_INDEX * n * k)  # arange, remainder
    seq.alloc(chosen)  # the gathered logits
    if low:
        seq.alloc(f32_chosen).free(chosen).alloc(f32_chosen).free(f32_chosen).alloc(chosen)  # copy, sigmoid, cast
    else:
        seq.alloc(f32_chosen).free(chosen)  # sigmoid (its output is the weights)
    seq.alloc(_INDEX * n * k).alloc(row_index).free(_INDEX * n * k)
    seq.alloc(out.n_bytes)
    if low:
        seq.free(chosen)  # the (N, k) weights die unsaved
    back_peak = max(2 * f32_chosen + chosen, 2 * logits.n_bytes)
    return LayerCost(
        output=out,
        saves_inputs=(False,),
        saved_extra_bytes=tuple(extras),
        fwd_transient_bytes=seq.transient_over(sum(extras) + out.n_bytes),
        bwd_transient_bytes=max(0, back_peak - logits.n_bytes),
        fwd_bytes_moved=logits.n_bytes + 3 * chosen + 3 * f32_chosen + 3 * row_index + out.n_bytes,
        bwd_bytes_moved=2 * out.n_bytes + 4 * f32_chosen + 2 * logits.n_bytes,
        fwd_kernels=8 if low else 6, bwd_kernels=7 if low else 5,
    )


@register(OpKind.MOE_SCALE)
def moe_scale_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Llama 4: ``rows * weights.to(rows.dtype).view(E, C, 1)``, each expert row (R, D) times its
    routing weight before the experts (transformers 5.24.0 ``Llama4TextMoe``: ``routed_in =
    hidden * scores``). The product saves both operands: the rows and the weights (a copy in the
    rows' dtype where they differ). Backward: the rows' gradient (R, D) and the weights' through
    an (R, D) product summed to (R,), cast back."""
    rows, weights = ctx.inputs
    out = TensorInfo(numel=rows.numel, dtype=rows.dtype)
    cast = weights.dtype is not rows.dtype
    copy = weights.numel * rows.dtype.n_bytes
    return LayerCost(
        output=out,
        saves_inputs=(True, not cast),
        saved_extra_bytes=(copy,) if cast else (),
        bwd_transient_bytes=rows.n_bytes + copy,
        fwd_bytes_moved=2 * rows.n_bytes + 2 * copy,
        bwd_bytes_moved=4 * rows.n_bytes + 2 * copy,
        fwd_kernels=2 if cast else 1, bwd_kernels=4 if cast else 3,
    )


@register(OpKind.MOE_GATHER)
def moe_gather_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Llama 4: ``zeros(N, D).index_add_(0, slots, rows)``, the experts' (already weighted) output
    rows summed into their tokens, in the rows' dtype. index_add saves the slots and its source
    (its derivative reads ``source.dim()``). Backward: the output's gradient gathered back
    (R, D): the rows' gradient itself."""
    rows_out, slots = ctx.inputs
    out = TensorInfo(numel=ctx.tokens * spec.in_features, dtype=rows_out.dtype)
    return LayerCost(
        output=out,
        saves_inputs=(True, True),
        releases_output_grad=True,
        fwd_bytes_moved=2 * rows_out.n_bytes + 2 * out.n_bytes + slots.n_bytes,
        bwd_bytes_moved=2 * rows_out.n_bytes + slots.n_bytes,
        fwd_kernels=2, bwd_kernels=1,
    )


@register(OpKind.CLAMPED_SWIGLU)
def clamped_swiglu_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """gpt-oss's expert activation over gate_up (E, C, 2I), gate and up interleaved (transformers
    5.24.0 ``GptOssExperts._apply_gate``): ``gate.clamp(max=l)``, ``up.clamp(-l, l)`` (each saves
    its input, a strided view of gate_up: gate_up itself is kept), ``gate * sigmoid(gate * alpha)``
    (sigmoid saves its output, the product both operands), ``(up + 1) * glu`` (saves both).
    Output (E, C, I) (u bytes); saved: gate_up, the clamped gate, the sigmoid, the glu and up + 1
    (4 u). The clamped up is a local until the function returns: one u more at the forward's peak
    (6 u with the output). Backward: the products' two gradients, the clamps' ``where`` and two
    ``slice_backward`` (2 u each) summed into gate_up's gradient, while the saved tensors are
    released: never above gate_up's gradient (2 u) beyond what it starts with. Read op by op from
    the live-storage tracker (fp32, bf16 under autocast, bf16). No matmul: FlopCounterMode counts
    none.
    """
    x = ctx.inputs[0]
    u = x.n_bytes // 2
    out = TensorInfo(numel=x.numel // 2, dtype=x.dtype)
    # clamped gate, clamped up, gate * alpha, sigmoid (the product dies), glu, up + 1, out; up dies at return
    seq = AllocSequence().alloc(u).alloc(u).alloc(u).alloc(u).free(u).alloc(u).alloc(u).alloc(u)
    # unsaved (a checkpointed block's forward): the sigmoid dies after the glu; the locals at return
    bare = AllocSequence().alloc(u).alloc(u).alloc(u).alloc(u).free(u).alloc(u).free(u).alloc(u).alloc(u)
    return LayerCost(
        output=out,
        saves_inputs=(True,),
        saved_extra_bytes=(u, u, u, u),
        fwd_transient_bytes=seq.transient_over(5 * u),
        unsaved_fwd_transient_bytes=bare.transient_over(u),
        fwd_bytes_moved=2 * x.n_bytes + 9 * u,
        bwd_bytes_moved=3 * x.n_bytes + 12 * u,
        fwd_kernels=7, bwd_kernels=10,
    )


@register(OpKind.MOE_COMBINE)
def moe_combine_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``zeros(N, D).index_add_(0, slots, rows * weights.to(rows.dtype)[:, None])``: (N, D) in the
    experts' dtype. The product saves both operands (the experts' output rows and the weights,
    cast to the rows' dtype when they differ: a copy); index_add saves the slots and its source,
    the weighted rows (R, D): its derivative formula reads ``source.dim()``, so autograd keeps it.

    Backward: the rows' gradient gathered back (R, D) (the weighted rows are released after that
    node, and the output's gradient too where nothing else holds it: under tensor parallelism
    it is the all-gathered gradient of the block's exit, read by nothing else), then the
    product's two gradients ((R, D) for the rows, an (R, D) product summed to (R,) for the
    weights), the weights' cast back to fp32.
    """
    rows_out, weights, slots = ctx.inputs
    d = spec.in_features
    n = ctx.tokens
    dtype = rows_out.dtype
    out = TensorInfo(numel=n * d, dtype=dtype)
    cast = weights.dtype is not dtype
    extras = (rows_out.n_bytes,) + ((weights.numel * dtype.n_bytes,) if cast else ())
    return LayerCost(
        output=out,
        saves_inputs=(True, not cast, True),
        saved_extra_bytes=extras,
        # the gathered gradient and the weights' product beside the rows' gradient; the weighted
        # rows (counted as saved until the op's backward ends) are already gone
        bwd_transient_bytes=rows_out.n_bytes + weights.numel * dtype.n_bytes,
        releases_output_grad=True,
        fwd_bytes_moved=3 * rows_out.n_bytes + 2 * out.n_bytes,
        bwd_bytes_moved=5 * rows_out.n_bytes + out.n_bytes,
        fwd_kernels=3 + (1 if cast else 0), bwd_kernels=4 + (1 if cast else 0),
    )


@register(OpKind.GATE_SCALE)
def gate_scale_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``x * sigmoid(g)`` with g (N, 1): sigmoid saves its output, the product saves x and it.

    Backward: x's gradient (N, D), g's through an (N, D) product summed to (N, 1) and sigmoid's
    backward (N, 1).

    The product packs its saved operands before it runs, so a checkpoint recompute ending here
    stops after the sigmoid, short of the product (measured: one (N, D) less)."""
    x, gate = ctx.inputs
    out = TensorInfo(numel=x.numel, dtype=x.dtype)
    return LayerCost(
        output=out,
        saves_inputs=(True, False),
        saved_extra_bytes=(gate.n_bytes,),
        bwd_transient_bytes=x.n_bytes + 2 * gate.n_bytes,
        fwd_bytes_moved=2 * x.n_bytes + 3 * gate.n_bytes,
        bwd_bytes_moved=4 * x.n_bytes + 4 * gate.n_bytes,
        fwd_kernels=2, bwd_kernels=4,
        saves_before_compute=True,
    )


@register(OpKind.PERMUTE_ROWS)
def permute_rows_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """Expert parallelism's regrouping of exchanged rows: (g, E/g, C, D) by source rank into
    (E/g, g C, D) by local expert, or back (``transpose(0, 1).reshape``: a copy). Saves nothing;
    its backward is a transposed view of the gradient (no copy)."""
    x = ctx.inputs[0]
    return LayerCost(
        output=TensorInfo(numel=x.numel, dtype=x.dtype),
        grad_aliases_inputs=(True,),
        fwd_bytes_moved=2 * x.n_bytes,
        fwd_kernels=1,
        bwd_kernels=0,
    )
