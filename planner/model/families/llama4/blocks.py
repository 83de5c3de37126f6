"""Llama 4's attention ops between the rotary and the core (``ModelConfig.llama4``), as the
reference model's ``validate.models.llama4.Llama4Attention`` runs them; ``planner.graph.blocks``
writes the rest of the attention around them (and skips the rotary on the no-RoPE blocks)."""

from __future__ import annotations

from planner.graph.description import OpDesc, TpRole
from planner.model.config import ModelConfig
from planner.ops.base import OpKind


def llama4_qk_ops(model: ModelConfig, b: int, qk: tuple[str, ...]) -> tuple[list[OpDesc], tuple[str, ...]]:
    """Block ``b``'s ops on q and k before the core, and the q/k names the core takes: on a RoPE
    block the L2 norm of the rotary's (q, k) output; on a no-RoPE block q's temperature."""
    settings = model.llama4
    assert settings is not None
    p = f"blocks.{b}.attn"
    heads = (("head_dim", model.head_dim), ("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads))
    if settings.rotary(b) and settings.qk_l2_norm:
        op = OpDesc(name=f"{p}.qk_l2_norm", kind=OpKind.QK_L2_NORM, inputs=qk, block=b, fields=heads,
                    tp=TpRole.LOCAL)
        return [op], (op.name,)
    if not settings.rotary(b) and settings.temperature_tuning:
        op = OpDesc(name=f"{p}.temperature", kind=OpKind.ATTN_TEMPERATURE, inputs=(qk[0],), block=b,
                    tp=TpRole.LOCAL)
        return [op], (op.name, *qk[1:])
    return [], qk
