"""Multi-head latent attention's ops (``ModelConfig.mla``), as the reference model's
``validate.models.deepseek.MlaAttention`` runs them; ``planner.graph.blocks`` writes the rest of
the block around them."""

from __future__ import annotations

from planner.graph.description import OpDesc, TpRole, linear_op, simple_op
from planner.model.config import ModelConfig
from planner.ops.base import OpKind, OpVariant, ParamTensor


def _slice(name: str, block: int, x: str, keep: int, of: int) -> OpDesc:
    """A view of ``keep`` of every ``of`` columns of ``x`` (``x[..., a:b]``: no copy)."""
    return OpDesc(name=name, kind=OpKind.SLICE, inputs=(x,), block=block, tp=TpRole.LOCAL,
                  fields=(("in_features", of), ("out_features", keep)))


def _latent_norm(name: str, block: int, x: str, width: int) -> OpDesc:
    """MLA's q_a_layernorm / kv_a_layernorm: RMSNorm in fp32, cast back before its weight."""
    return OpDesc(name=name, kind=OpKind.RMSNORM, inputs=(x,), block=block,
                  params=(ParamTensor(name=f"{name}.weight", numel=width),),
                  fields=(("in_features", width), ("variant", OpVariant.NORM_FP32)), tp=TpRole.REPLICATE)


def mla_attention_ops(model: ModelConfig, b: int, x: str, rope: str | None
                      ) -> tuple[list[OpDesc], list[tuple[str, str]], str]:
    """Block ``b``'s multi-head latent attention up to its core (``validate.models.deepseek``, in
    its order): the query (bottleneck or plain), the shared latent and its rotary key (views of one
    projection), kv_b_proj, rotary on the rope parts, q and k concatenated, v a view; the frame
    holds of ``MlaAttention.project``'s locals; the core's name."""
    mla = model.mla
    assert mla is not None and rope is not None, "multi-head latent attention needs rotary positions"
    n, d = model.n_heads, model.d_model
    nope, rdim, vdim, qk = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.qk_head_dim
    r = mla.kv_lora_rank
    bias = bool(model.qkv_bias)
    p = f"blocks.{b}.attn"
    ops: list[OpDesc] = []

    def add(op: OpDesc) -> str:
        ops.append(op)
        return op.name

    if mla.q_lora_rank is None:
        q = add(linear_op(f"{p}.q_proj", b, x, d, n * qk, False, TpRole.COLWISE))
    else:
        q = add(linear_op(f"{p}.q_a_proj", b, x, d, mla.q_lora_rank, bias, TpRole.REPLICATE))
        q = add(_latent_norm(f"{p}.q_a_layernorm", b, q, mla.q_lora_rank))
        q = add(linear_op(f"{p}.q_b_proj", b, q, mla.q_lora_rank, n * qk, False, TpRole.COLWISE))
    latent = add(linear_op(f"{p}.kv_a_proj_with_mqa", b, x, d, r + rdim, bias, TpRole.REPLICATE))
    normed = add(_latent_norm(f"{p}.kv_a_layernorm", b, add(_slice(f"{p}.kv_latent", b, latent, r, r + rdim)), r))
    kv = add(linear_op(f"{p}.kv_b_proj", b, normed, r, n * (nope + vdim), False, TpRole.COLWISE))
    rot = add(simple_op(f"{p}.rotary", OpKind.ROTARY, b, add(_slice(f"{p}.q_rope", b, q, rdim, qk)),
                         add(_slice(f"{p}.k_rope", b, latent, rdim, r + rdim)), rope, tp=TpRole.LOCAL))

    def concat(name: str, part: str, rope_heads: int) -> str:
        fields = {"in_features": nope, "out_features": qk, "n_heads": n, "n_kv_heads": rope_heads}
        return add(OpDesc(name=f"{p}.{name}", kind=OpKind.MLA_CONCAT, inputs=(part, rot), block=b, tp=TpRole.HEADS,
                          fields=tuple(sorted(fields.items()))))

    q_full = concat("q_concat", add(_slice(f"{p}.q_nope", b, q, nope, qk)), n)
    k_full = concat("k_concat", add(_slice(f"{p}.k_nope", b, kv, nope, nope + vdim)), 1)
    v = add(_slice(f"{p}.value", b, kv, vdim, nope + vdim))
    core_fields: dict[str, object] = {"n_heads": n, "n_kv_heads": n, "head_dim": qk, "v_head_dim": vdim,
                                      "dropout": model.dropout, "attention_kernel": model.attention_kernel}
    core = add(OpDesc(name=f"{p}.core", kind=OpKind.ATTENTION_FLASH, inputs=(q_full, k_full, v), block=b,
                      fields=tuple(sorted(core_fields.items())), tp=TpRole.HEADS))
    # MlaAttention.project's locals (q, the latent, kv, the rotary outputs) live until it returns
    return ops, [(q, v), (latent, v), (kv, v), (rot, v)], core
