"""The MoE MLP's ops, as the reference MoE block runs them (``validate.models.moe.MoE``), for every
family with ``ModelConfig.moe`` (its sparse blocks; ``planner.graph.blocks`` writes the rest)."""

from __future__ import annotations

from planner.graph.description import OpDesc, TpRole, linear_op, simple_op
from planner.model.config import ModelConfig
from planner.model.families.moe.config import ExpertActivation, RouterScoring
from planner.ops.base import OpKind, ParamTensor


def moe_block_ops(model: ModelConfig, b: int, normed: str) -> tuple[list[OpDesc], list[tuple[str, str]], str]:
    """The MoE MLP of block ``b`` (``validate.models.moe.MoE``): slots, dispatch, the experts'
    grouped SwiGLU, router, route, combine, and the shared experts; its frame holds; its output.
    Llama 4 (``RouterScoring.TOPK_SIGMOID``): slots, dispatch, router, route, the rows scaled by
    their weights, the experts, their rows gathered unweighted, the shared expert."""
    moe = model.moe
    assert moe is not None
    d, i, e = model.d_model, moe.d_ff_expert, moe.n_experts
    p = f"blocks.{b}.mlp"
    ops: list[OpDesc] = []

    def add(op: OpDesc) -> str:
        ops.append(op)
        return op.name

    def grouped(name: str, x: str, fan_in: int, fan_out: int, tp: TpRole) -> str:
        # FSDP2 shards the (E, in, out) weights along dim 1 (validate.apply's shard_placement_fn;
        # torchtitan too when the shard degree exceeds E), the (E, out) biases along dim 0
        params: tuple[ParamTensor, ...] = (
            ParamTensor(name=f"{p}.experts.{name}.weight", numel=e * fan_in * fan_out, rows=fan_in, shard_dim=1),)
        if moe.expert_bias:
            params += (ParamTensor(name=f"{p}.experts.{name}.bias", numel=e * fan_out, rows=e),)
        return add(OpDesc(name=f"{p}.experts.{name}", kind=OpKind.GROUPED_LINEAR, inputs=(x,), block=b, params=params,
                          fields=(("bias", moe.expert_bias), ("in_features", fan_in), ("moe", moe),
                                  ("out_features", fan_out)), tp=tp))

    slots = add(OpDesc(name=f"{p}.slots", kind=OpKind.MOE_SLOTS, block=b, fields=(("moe", moe),)))
    rows = add(OpDesc(name=f"{p}.dispatch", kind=OpKind.MOE_DISPATCH, inputs=(normed, slots), block=b,
                      fields=(("in_features", d),)))
    scores_input = moe.scoring is RouterScoring.TOPK_SIGMOID
    if scores_input:  # Llama 4: the router first, its weights scale the rows the experts take
        logits = add(linear_op(f"{p}.router", b, normed, d, e, moe.router_bias, TpRole.REPLICATE))
        weights = add(OpDesc(name=f"{p}.route", kind=OpKind.MOE_ROUTE, inputs=(logits,), block=b,
                             fields=(("moe", moe),)))
        rows = add(OpDesc(name=f"{p}.scale", kind=OpKind.MOE_SCALE, inputs=(rows, weights), block=b))
    # tensor parallelism splits every expert's inner size I (torchtitan's TensorParallel of GroupedExperts;
    # gpt-oss's biased, interleaved experts are refused under tensor parallelism)
    if moe.expert_activation is ExpertActivation.CLAMPED_SWIGLU:  # gpt-oss: (gate, up) interleaved
        gate_up = grouped("gate_up_proj", rows, d, 2 * i, TpRole.COLWISE)
        hidden = add(OpDesc(name=f"{p}.experts.act", kind=OpKind.CLAMPED_SWIGLU, inputs=(gate_up,), block=b,
                            tp=TpRole.LOCAL))
    elif moe.expert_activation is ExpertActivation.FUSED_SWIGLU:  # Llama 4: (gate, up) halves of one gate_up_proj
        gate_up = grouped("gate_up_proj", rows, d, 2 * i, TpRole.COLWISE)
        gate = add(OpDesc(name=f"{p}.experts.gate", kind=OpKind.SLICE, inputs=(gate_up,), block=b, tp=TpRole.LOCAL,
                          fields=(("in_features", 2 * i), ("out_features", i))))
        act = add(simple_op(f"{p}.experts.act", OpKind.SILU, b, gate, tp=TpRole.LOCAL))
        up = add(OpDesc(name=f"{p}.experts.up", kind=OpKind.SLICE, inputs=(gate_up,), block=b, tp=TpRole.LOCAL,
                        fields=(("in_features", 2 * i), ("out_features", i))))
        hidden = add(simple_op(f"{p}.experts.glu", OpKind.GLU_MUL, b, act, up, tp=TpRole.LOCAL))
    else:
        gate = grouped("gate_proj", rows, d, i, TpRole.COLWISE)
        act = add(simple_op(f"{p}.experts.act", OpKind.SILU, b, gate, tp=TpRole.LOCAL))
        up = grouped("up_proj", rows, d, i, TpRole.COLWISE)
        hidden = add(simple_op(f"{p}.experts.glu", OpKind.GLU_MUL, b, act, up, tp=TpRole.LOCAL))
    out = grouped("down_proj", hidden, i, d, TpRole.ROWWISE)
    if scores_input:  # the rows are weighted already: summed into their tokens as they are
        y = add(OpDesc(name=f"{p}.gather", kind=OpKind.MOE_GATHER, inputs=(out, slots), block=b,
                       fields=(("in_features", d),)))
    else:
        logits = add(linear_op(f"{p}.router", b, normed, d, e, moe.router_bias, TpRole.REPLICATE))
        weights = add(OpDesc(name=f"{p}.route", kind=OpKind.MOE_ROUTE, inputs=(logits,), block=b,
                             fields=(("moe", moe),)))
        y = add(OpDesc(name=f"{p}.combine", kind=OpKind.MOE_COMBINE, inputs=(out, weights, slots), block=b,
                       fields=(("in_features", d),)))
    if moe.shared_d_ff:
        s = f"{p}.shared_expert"
        sg = add(linear_op(f"{s}.gate_proj", b, normed, d, moe.shared_d_ff, False, TpRole.COLWISE))
        sa = add(simple_op(f"{s}.act", OpKind.SILU, b, sg, tp=TpRole.LOCAL))
        su = add(linear_op(f"{s}.up_proj", b, normed, d, moe.shared_d_ff, False, TpRole.COLWISE))
        sh = add(simple_op(f"{s}.glu", OpKind.GLU_MUL, b, sa, su, tp=TpRole.LOCAL))
        shared = add(linear_op(f"{s}.down_proj", b, sh, moe.shared_d_ff, d, False, TpRole.ROWWISE))
        if moe.shared_gate:
            g = add(linear_op(f"{p}.shared_gate", b, normed, d, 1, False, TpRole.REPLICATE))
            shared = add(OpDesc(name=f"{p}.shared_scale", kind=OpKind.GATE_SCALE, inputs=(shared, g), block=b))
        y = add(simple_op(f"{p}.shared_add", OpKind.RESIDUAL_ADD, b, y, shared))
    return ops, [(slots, y)], y  # MoE.forward's local ``tokens``
