"""Linear layers (projections, MLP, LM head): the matmuls that dominate FLOPs."""

from __future__ import annotations

from hardware.collectives import Collective
from hardware.kernels import GemmShape
from planner.ops.base import (
    CollectiveCall,
    LayerCost,
    LayerSpec,
    OpContext,
    OpKind,
    OpVariant,
    TensorInfo,
    linear_flops,
)
from planner.ops.registry import register, register_variant


@register(OpKind.LINEAR)
def linear_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``y = x W^T + b`` with x (B, T, I), W (O, I): one (B*T) x I x O matmul.

    FLOPs (lecture; FlopCounterMode's mm/addmm): forward 2*B*T*I*O; backward 2*B*T*I*O for the
    input gradient (only if the input requires grad) and 2*B*T*I*O for the weight gradient.

    Memory: ``addmm``/``mm`` on a flattened view save the input and the weight. Under autocast
    the input is cast to the low-precision dtype first (a new copy, saved instead of the input;
    autocast does not cache non-leaf casts, so q/k/v each keep their own copy) and the weight and
    bias casts are cached for the whole forward and saved. Backward then computes the input and
    weight gradients in low precision and casts them back (transients).

    A frozen weight (``ParamTensor.frozen``: a fine-tuning plan's base linear) gets no gradient,
    and autograd saves only what the input gradient needs: torch 2.13's generated autograd code
    (``tools/autograd/gen_variable_type.py``) saves each input of ``mm``/``addmm`` under
    ``grad_fn->should_compute_output(...)`` of the other one, so the input (or its autocast
    copy, then a forward transient) is not saved, the weight is. Autocast caches only casts of
    leaves that require grad (``cached_cast``, ``aten/src/ATen/autocast_mode.cpp``), so a frozen
    fp32 weight is cast afresh by every call and that copy is the matmul's own, saved while the
    input requires grad (measured with the tracker: output + the bf16 weight copy). Backward runs
    the input gradient only (no weight-gradient FLOPs).
    """
    return _matmul_cost(spec, ctx, groups=1)


@register(OpKind.GROUPED_LINEAR)
def grouped_linear_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """``bmm(x, W)`` with x (E, C, I), W (E, I, O): E experts' linears over C rows each (the
    reference MoE's experts; a grouped GEMM with equal groups).

    FLOPs (FlopCounterMode's bmm): forward 2*E*C*I*O, backward twice that. Memory as a linear's:
    bmm saves both operands, so the rows (or their autocast copy) and the weight (or its cached
    autocast copy); the low-precision weight gradient is a transient before its cast to fp32.

    With an (E, O) bias (gpt-oss's experts): ``baddbmm(bias[:, None], x, W)``, FlopCounterMode's
    baddbmm counting the bmm alone. Autocast casts the bias view afresh each call (it caches only
    leaf tensors): a forward transient, not saved (baddbmm's backward reads no bias).
    """
    assert spec.moe is not None
    return _matmul_cost(spec, ctx, groups=spec.moe.n_experts)


def _matmul_cost(spec: LayerSpec, ctx: OpContext, groups: int) -> LayerCost:
    """A linear (``groups`` 1) or ``groups`` equal linears over as many groups of x's rows."""
    x = ctx.inputs[0]
    i, o = spec.in_features, spec.out_features
    tokens = x.numel // i
    low = ctx.precision.autocast_dtype
    out_dtype = low or x.dtype
    out = TensorInfo(numel=tokens * o, dtype=out_dtype)
    weight_numel = groups * (i * o + (o if spec.bias else 0))
    param_dtype = ctx.precision.param_dtype
    casts_input = low is not None and x.dtype != low
    saved_extra: tuple[int, ...] = ()
    autocast_copies: tuple[int, ...] = ()
    bwd_transient = 0
    fwd_transient = 0
    if low is not None:
        cached_bias = spec.bias and groups == 1  # a linear's bias is a leaf: autocast caches its copy
        autocast_copies = (groups * i * o * low.n_bytes,) + ((groups * o * low.n_bytes,) if cached_bias else ())
        if spec.bias and not cached_bias:
            fwd_transient = groups * o * low.n_bytes
        bwd_transient = groups * i * o * low.n_bytes  # low-precision weight grad before its cast to fp32
    if casts_input:
        assert low is not None
        saved_extra = (x.numel * low.n_bytes,)
        bwd_transient += x.numel * low.n_bytes  # grad of the copy, before the cast back
    compute_bytes = out_dtype.n_bytes
    flops = linear_flops(tokens, i, o)
    if spec.params and all(p.frozen for p in spec.params):
        return _frozen_matmul_cost(spec, ctx, groups, out, flops, casts_input)
    if casts_input and not x.requires_grad:  # the copy gets no gradient of its own
        bwd_transient -= x.numel * low.n_bytes  # type: ignore[union-attr]
    return LayerCost(
        fwd_flops=flops,
        bwd_input_flops=flops if x.requires_grad else 0.0,
        bwd_weight_flops=flops,
        fwd_bytes_moved=(x.numel + groups * i * o + tokens * o) * compute_bytes,
        bwd_bytes_moved=(2 * tokens * o + 2 * x.numel + 2 * groups * i * o) * compute_bytes,
        fwd_kernels=1 + (2 if low is not None else 0),
        bwd_kernels=2 + (1 if spec.bias else 0),
        matmul=True,
        gemm=GemmShape(m=tokens // groups, n=o, k=i, batch=groups),
        output=out,
        saves_inputs=(not casts_input,),
        saved_extra_bytes=saved_extra,
        autocast_copy_bytes=autocast_copies,
        fwd_transient_bytes=fwd_transient,
        bwd_transient_bytes=bwd_transient,
        param_numel=weight_numel if spec.owns_params else 0,
        param_dtype=param_dtype,
        saves_before_compute=True,
    )


def _frozen_matmul_cost(spec: LayerSpec, ctx: OpContext, groups: int, out: TensorInfo, flops: float,
                        casts_input: bool) -> LayerCost:
    """A matmul whose weight (and bias) are frozen (``linear_cost``): the weight (or its uncached
    autocast copy) saved for the input gradient, nothing of the input; backward: the input
    gradient alone (and, under autocast, the gradient of the input's copy before its cast back)."""
    x = ctx.inputs[0]
    i, o = spec.in_features, spec.out_features
    tokens = x.numel // i
    low = ctx.precision.autocast_dtype
    compute_bytes = out.dtype.n_bytes
    copies: tuple[int, ...] = ()
    fwd_transient = 0
    if low is not None and ctx.precision.param_dtype != low:
        copies = (groups * i * o * low.n_bytes,)
        fwd_transient = groups * o * low.n_bytes if spec.bias else 0  # addmm's backward reads no bias
    if casts_input:
        assert low is not None
        fwd_transient += x.numel * low.n_bytes  # the input's copy, used by the kernel and dropped
    return LayerCost(
        fwd_flops=flops,
        bwd_input_flops=flops if x.requires_grad else 0.0,
        fwd_bytes_moved=(x.numel + groups * i * o + tokens * o) * compute_bytes,
        bwd_bytes_moved=(tokens * o + groups * i * o + x.numel) * compute_bytes,
        fwd_kernels=1 + (2 if low is not None else 0),
        bwd_kernels=1,
        matmul=True,
        gemm=GemmShape(m=tokens // groups, n=o, k=i, batch=groups),
        output=out,
        saves_inputs=(False,),
        autocast_copy_bytes=copies,
        autocast_copies_cached=False,
        fwd_transient_bytes=fwd_transient,
        bwd_transient_bytes=x.numel * low.n_bytes if casts_input and low is not None and x.requires_grad else 0,
        param_numel=groups * (i * o + (o if spec.bias else 0)) if spec.owns_params else 0,
        param_dtype=ctx.precision.param_dtype,
        saves_before_compute=True,
    )


@register_variant(OpKind.LINEAR, OpVariant.LOCAL_WEIGHT)
@register_variant(OpKind.GROUPED_LINEAR, OpVariant.LOCAL_WEIGHT)
def local_weight_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """A linear (or the experts' bmm) of a tensor-parallel MoE block, run on the local shard of its
    DTensor weight (``weight.to_local()``, as torchtitan's ``GroupedExperts`` does; the shapes are
    the rank's: out_features or in_features already split). FLOPs and bytes as the reference's.

    Memory: ``to_local()`` is a view, and autocast caches only the casts of leaf tensors that are
    no views (``cached_cast``, aten/src/ATen/autocast_mode.cpp): the low-precision weight copy is
    the matmul's own, saved by it, so in a checkpointed unit's forward it dies with the op (not
    when autocast exits), and a bias's copy always does. Without autocast nothing differs."""
    cost = _matmul_cost(spec, ctx, groups=spec.moe.n_experts if spec.kind is OpKind.GROUPED_LINEAR and spec.moe else 1)
    if not cost.autocast_copy_bytes:
        return cost
    weight, *bias = cost.autocast_copy_bytes
    return cost.model_copy(update={"autocast_copy_bytes": (weight,), "autocast_copies_cached": False,
                                   "fwd_transient_bytes": cost.fwd_transient_bytes + sum(bias)})


@register_variant(OpKind.LINEAR, OpVariant.REPLICATED_WEIGHT)
def replicated_weight_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """The router (or a shared-expert gate) of a tensor-parallel MoE block: whole on every rank of
    the group (``spec.group_size``) and run on all tokens, on its weight's local view
    (``LOCAL_WEIGHT``). The gradient reaching its logits is a partial sum (the experts' outputs
    it weights are), so its weight gradient is too: all-reduced over the group in the backward
    (``_c10d_functional.all_reduce``: a contiguous copy beside the gradient). The input gradient
    stays partial and joins the block's at its exit collective."""
    cost = local_weight_cost(spec, ctx)
    grad = spec.in_features * spec.out_features * ctx.precision.param_dtype.n_bytes
    call = CollectiveCall(kind=Collective.ALL_REDUCE, n_bytes=grad, group_size=spec.group_size,
                          ranks_per_node=spec.ranks_per_node)
    return cost.model_copy(update={"bwd_collectives": (call,),
                                   "bwd_transient_bytes": max(cost.bwd_transient_bytes, grad)})
