"""One description of the model: every op of a training step's forward, in order.

Each ``OpDesc`` names its op after the reference model's module (``blocks.3.attn.q_proj``), says
which tensors it consumes, which parameters it owns (state-dict names and shapes) and how tensor
parallelism splits it (``TpRole``, as PyTorch's ``parallelize_module`` styles do). The layer
graph (``planner.graph.layer_graph``) and the parameter list (``planner.graph.params``) are both generated from
it, and a strategy that shards the model (``planner.parallel.strategies``) rewrites the description
before the graph is built. ``validate.reference_model`` registers the same modules under the
same names, in the same order (tests/planner/test_blocks.py checks it against torch).

Per block (pre-norm, Llama form; GPT-2 swaps SwiGLU for GELU and adds biases):
``attn_norm -> q, k, v -> [rotary] -> core -> o -> [dropout] -> + x -> mlp_norm ->
[gate -> act], up -> [glu | act] -> down -> [dropout] -> + x``. Post-norm blocks (OLMo 2) run
``attn_norm`` after the attention's [dropout] and ``mlp_norm`` after the MLP's, each just before
its residual add. A family's own parts come from its package: the MoE MLP of sparse blocks
(``planner.model.families.moe.blocks``), multi-head latent attention
(``planner.model.families.deepseek.blocks``).
"""

from __future__ import annotations

from functools import lru_cache

from planner.finetune.lora import lora_description
from planner.graph.description import ModelDesc, OpDesc, TpRole
from planner.graph.description import linear_op as _linear
from planner.graph.description import simple_op as _simple
from planner.graph.implementations import adapt
from planner.model.config import AttentionImpl, MlpKind, ModelConfig, NormKind, NormPlacement, PositionKind, QkNorm
from planner.model.families.deepseek.blocks import mla_attention_ops
from planner.model.families.llama4.blocks import llama4_qk_ops
from planner.model.families.moe.blocks import moe_block_ops
from planner.model.families.phi3.blocks import fused_mlp_ops, fused_qkv_ops, merge_heads_op, rotary_op
from planner.ops.base import OpKind, OpVariant, ParamTensor


def _norm(model: ModelConfig, name: str, block: int | None, x: str) -> OpDesc:
    layernorm = model.norm is NormKind.LAYERNORM
    params: tuple[ParamTensor, ...] = (ParamTensor(name=f"{name}.weight", numel=model.d_model),)
    if layernorm and model.norm_bias:
        params += (ParamTensor(name=f"{name}.bias", numel=model.d_model),)
    fields: tuple[tuple[str, object], ...] = (("in_features", model.d_model),)
    if model.norm is NormKind.GEMMA_RMSNORM:  # planner.ops.gemma
        fields += (("variant", OpVariant.NORM_GEMMA),)
    return OpDesc(name=name, kind=OpKind.LAYERNORM if layernorm else OpKind.RMSNORM, inputs=(x,), block=block,
                  params=params, fields=fields, tp=TpRole.SEQUENCE)


def block_ops(model: ModelConfig, b: int, x: str, rope: str | None, mask: str | None
              ) -> tuple[list[OpDesc], list[tuple[str, str]], str]:
    """Block ``b``'s ops (taking the residual stream ``x``), its frame holds, and its output."""
    m = model
    n, d = m.n_heads, m.d_model
    p = f"blocks.{b}"
    ops: list[OpDesc] = []
    holds: list[tuple[str, str]] = []

    def add(op: OpDesc) -> str:
        ops.append(op)
        return op.name

    post = m.norm_placement is NormPlacement.POST  # OLMo 2: each branch normed on its way out
    sandwich = m.norm_placement is NormPlacement.SANDWICH  # Gemma: normed on its way in and out
    normed = x if post else add(_norm(m, f"{p}.attn_norm", b, x))
    if m.mla is not None:
        attn_ops, attn_holds, core = mla_attention_ops(m, b, normed, rope)
        ops.extend(attn_ops)
        holds.extend(attn_holds)
        attn = add(_linear(f"{p}.attn.o_proj", b, core, n * m.mla.v_head_dim, d, bool(m.attn_out_bias), TpRole.ROWWISE))
    else:
        attn = add(_mha_ops(m, b, normed, rope, mask, ops))
    holds.append((normed, attn))  # Attention.forward's argument
    if m.dropout > 0:
        attn = add(_simple(f"{p}.attn_dropout", OpKind.DROPOUT, b, attn, dropout=m.dropout))
    if post:
        attn = add(_norm(m, f"{p}.attn_norm", b, attn))
    if sandwich:
        attn = add(_norm(m, f"{p}.attn_post_norm", b, attn))
    x = add(_simple(f"{p}.attn_residual", OpKind.RESIDUAL_ADD, b, x, attn))
    normed = x if post else add(_norm(m, f"{p}.mlp_norm", b, x))
    bias = bool(m.mlp_bias)
    if m.moe is not None and m.moe.is_sparse(b):
        moe_ops, moe_holds, mlp = moe_block_ops(m, b, normed)
        ops.extend(moe_ops)
        holds.extend(moe_holds)
    elif m.fused_projections:  # Phi-3's gate_up_proj
        fused_ops, hidden = fused_mlp_ops(m, b, normed)
        ops.extend(fused_ops)
    elif m.mlp in (MlpKind.SWIGLU, MlpKind.GEGLU):
        gate = add(_linear(f"{p}.mlp.gate_proj", b, normed, d, m.d_ff, bias, TpRole.COLWISE))
        gate_act = OpKind.SILU if m.mlp is MlpKind.SWIGLU else OpKind.GELU  # GeGLU: tanh GELU of the gate
        act = add(_simple(f"{p}.mlp.act", gate_act, b, gate, tp=TpRole.LOCAL))
        up = add(_linear(f"{p}.mlp.up_proj", b, normed, d, m.d_ff, bias, TpRole.COLWISE))
        hidden = add(_simple(f"{p}.mlp.glu", OpKind.GLU_MUL, b, act, up, tp=TpRole.LOCAL))
    else:
        up = add(_linear(f"{p}.mlp.up_proj", b, normed, d, m.d_ff, bias, TpRole.COLWISE))
        hidden = add(_simple(f"{p}.mlp.act", OpKind.GELU, b, up, tp=TpRole.LOCAL))
    if m.moe is None or not m.moe.is_sparse(b):
        mlp = add(_linear(f"{p}.mlp.down_proj", b, hidden, m.d_ff, d, bias, TpRole.ROWWISE))
    holds.append((normed, mlp))  # Mlp.forward's argument
    if m.dropout > 0:
        mlp = add(_simple(f"{p}.mlp_dropout", OpKind.DROPOUT, b, mlp, dropout=m.dropout))
    if post:
        mlp = add(_norm(m, f"{p}.mlp_norm", b, mlp))
    if sandwich:
        mlp = add(_norm(m, f"{p}.mlp_post_norm", b, mlp))
    out = add(_simple(f"{p}.mlp_residual", OpKind.RESIDUAL_ADD, b, x, mlp))
    return ops, holds, out


def _mha_ops(m: ModelConfig, b: int, normed: str, rope: str | None, mask: str | None, ops: list[OpDesc]) -> OpDesc:
    """Multi-head (grouped-query) attention's q, k, v, [q/k norms], [rotary], core into ``ops``;
    returns its o_proj (not yet added)."""
    n, k, h, d = m.n_heads, m.kv_heads, m.head_dim, m.d_model
    p = f"blocks.{b}"

    def add(op: OpDesc) -> str:
        ops.append(op)
        return op.name

    if m.fused_projections:  # Phi-3's qkv_proj, sliced into q, k, v
        fused_ops, (q, kk, v) = fused_qkv_ops(m, b, normed)
        ops.extend(fused_ops)
    else:
        q = add(_linear(f"{p}.attn.q_proj", b, normed, d, n * h, bool(m.qkv_bias), TpRole.COLWISE))
        q = add(_qk_norm(m, f"{p}.attn.q_norm", b, q, n)) if m.qk_norm not in (None, QkNorm.NONE) else q
        kk = add(_linear(f"{p}.attn.k_proj", b, normed, d, k * h, bool(m.qkv_bias), TpRole.COLWISE))
        kk = add(_qk_norm(m, f"{p}.attn.k_norm", b, kk, k)) if m.qk_norm not in (None, QkNorm.NONE) else kk
        v = add(_linear(f"{p}.attn.v_proj", b, normed, d, k * h, bool(m.qkv_bias), TpRole.COLWISE))
    qk: tuple[str, ...] = (q, kk)
    if rope is not None and (m.llama4 is None or m.llama4.rotary(b)):  # Llama 4's no-RoPE blocks skip it
        qk = (add(rotary_op(m, b, q, kk, rope)),)
    if m.llama4 is not None:  # its q/k L2 norm or q's temperature (planner.model.families.llama4.blocks)
        llama4_ops, qk = llama4_qk_ops(m, b, qk)
        ops.extend(llama4_ops)
    eager = m.attention is AttentionImpl.EAGER
    core_fields: dict[str, object] = {"n_heads": n, "n_kv_heads": k, "head_dim": h, "dropout": m.dropout,
                                      "attention_kernel": m.attention_kernel}
    if m.window(b) is not None:  # priced as the kernel runs it (planner.ops.attention)
        core_fields["window"] = m.window(b)
    if m.attn_logit_softcapping is not None and eager:  # Gemma 2: c tanh(s / c) of the scores (planner.ops.attention)
        core_fields["softcap"] = True
    sinks: tuple[ParamTensor, ...] = ()
    if m.attention_sinks:  # gpt-oss: one sink logit per head, owned by the core
        core_fields["sinks"] = True
        sinks = (ParamTensor(name=f"{p}.attn.core.sinks", numel=n),)
    core = add(OpDesc(name=f"{p}.attn.core", kind=OpKind.ATTENTION_EAGER if eager else OpKind.ATTENTION_FLASH,
                      inputs=(*qk, v) + ((mask,) if eager and mask is not None else ()), block=b, params=sinks,
                      fields=tuple(sorted(core_fields.items())), tp=TpRole.HEADS))
    if not eager and rope is not None and m.rope_dim < h:  # partial rotary: a head-major query and output
        core = add(merge_heads_op(b, core))
    return _linear(f"{p}.attn.o_proj", b, core, n * h, d, bool(m.attn_out_bias), TpRole.ROWWISE)


def _qk_norm(model: ModelConfig, name: str, block: int, x: str, heads: int) -> OpDesc:
    """RMSNorm of q or k in fp32, cast back before its weight (transformers' Qwen3/OLMoE norm):
    over each head's H values (one (H,) weight) or over all heads' (one (heads H,) weight)."""
    width = model.head_dim if model.qk_norm is QkNorm.HEAD else heads * model.head_dim
    variant = OpVariant.NORM_GEMMA if model.norm is NormKind.GEMMA_RMSNORM else OpVariant.NORM_FP32  # Gemma 3's
    return OpDesc(name=name, kind=OpKind.RMSNORM, inputs=(x,), block=block,
                  params=(ParamTensor(name=f"{name}.weight", numel=width),),
                  fields=(("in_features", width), ("variant", variant)), tp=TpRole.LOCAL)


@lru_cache(maxsize=64)
def describe(model: ModelConfig) -> ModelDesc:
    """The whole model: embedding, positions, the blocks, final norm, LM head, loss, as
    ``model.implementation`` runs it (``planner.graph.implementations.adapt``)."""
    m = model
    ops: list[OpDesc] = []
    holds: list[tuple[str, str]] = []

    def add(op: OpDesc) -> str:
        ops.append(op)
        return op.name

    embed_param = ParamTensor(name="embed.weight", numel=m.vocab_size * m.d_model, rows=m.vocab_size)
    x = add(OpDesc(name="embed", kind=OpKind.EMBEDDING, params=(embed_param,), tp=TpRole.VOCAB,
                   fields=(("in_features", m.vocab_size), ("out_features", m.d_model))))
    if m.positions is PositionKind.LEARNED:
        rows = m.position_rows
        pos = add(OpDesc(name="pos_embed", kind=OpKind.POS_EMBEDDING, tp=TpRole.SEQUENCE,
                         params=(ParamTensor(name="pos_embed.weight", numel=rows * m.d_model, rows=rows),),
                         fields=(("in_features", rows), ("out_features", m.d_model))))
        x = add(_simple("embed_add", OpKind.RESIDUAL_ADD, None, x, pos))
    if m.scale_embeddings:  # Gemma: the embedding times sqrt(D) (planner.ops.scale)
        x = add(_simple("embed_scale", OpKind.SCALE, None, x))
    if m.dropout > 0:
        x = add(_simple("embed_dropout", OpKind.DROPOUT, None, x, dropout=m.dropout))
    rope = rope_local = None
    if m.positions is PositionKind.ROTARY:
        rope = add(OpDesc(name="rope", kind=OpKind.ROPE_TABLES, fields=(("head_dim", m.rope_dim),), shape_of=x))
        if m.local_rope:  # Gemma 3: the sliding blocks' own base, a second pair of tables
            rope_local = add(OpDesc(name="rope_local", kind=OpKind.ROPE_TABLES, fields=(("head_dim", m.rope_dim),),
                                    shape_of=x))
    mask = window_mask = None
    if m.attention is AttentionImpl.EAGER:
        mask = add(OpDesc(name="causal_mask", kind=OpKind.CAUSAL_MASK))
        if any(m.window(b) is not None for b in range(m.n_layers)):  # the sliding layers' mask
            window_mask = add(OpDesc(name="window_mask", kind=OpKind.CAUSAL_MASK, inputs=(mask,),
                                     fields=(("window", m.sliding_window),)))
    for b in range(m.n_layers):
        windowed = m.window(b) is not None
        block, block_holds, x = block_ops(m, b, x, rope_local if windowed and rope_local else rope,
                                          window_mask if windowed else mask)
        ops.extend(block)
        holds.extend(block_holds)
    x = add(_norm(m, "final_norm", None, x))
    tied = bool(m.tie_embeddings)
    logits = add(_linear("lm_head", None, x, m.d_model, m.vocab_size, False, TpRole.VOCAB, owns=not tied,
                         shared=embed_param if tied else None))
    if m.final_logit_softcapping is not None:  # Gemma 2: c tanh(z / c) of the logits (planner.ops.gemma)
        logits = add(_simple("logits_softcap", OpKind.LOGIT_SOFTCAP, None, logits, tp=TpRole.LOCAL))
    # the graph builder casts low-precision logits to fp32 before the loss (``.float()``)
    loss = add(OpDesc(name="loss", kind=OpKind.CROSS_ENTROPY, inputs=(logits,), tp=TpRole.VOCAB))
    for shared in (rope, rope_local, mask, window_mask):  # locals of Transformer.forward: alive for the whole forward
        if shared is not None:
            holds.append((shared, loss))
    desc = adapt(ModelDesc(ops=tuple(ops), held_until=tuple(holds)), model)
    if m.finetune is not None:  # adapters on a frozen base (planner.finetune.lora)
        desc = lora_description(desc, m.finetune, m.name)
    return desc
