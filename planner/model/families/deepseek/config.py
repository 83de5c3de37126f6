"""Multi-head latent attention (``ModelConfig.mla``; DeepSeek-V2/V3), in transformers' vocabulary.

Queries go through a low-rank bottleneck (``q_a_proj`` D -> q_lora_rank, an RMSNorm, ``q_b_proj``
-> N (nope + rope)) or a plain ``q_proj`` when ``q_lora_rank`` is None; keys and values share one
compressed latent (``kv_a_proj_with_mqa`` D -> kv_lora_rank + rope: the latent and one rotary key
shared by every head), normed, then expanded per head (``kv_b_proj`` -> N (nope + v)). Each query
and key head is the concatenation of a ``qk_nope_head_dim`` part without positions and a
``qk_rope_head_dim`` part with RoPE; values are ``v_head_dim`` wide, so ``o_proj`` maps N v -> D.
Field names follow transformers' ``DeepseekV3Config`` (``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``). DeepSeek-V3's defaults for the fields a
model file leaves out follow the class.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from planner.model.families.dense.config import FILE_DEFAULTS as DENSE_DEFAULTS
from planner.model.kinds import Family


class MlaConfig(BaseModel):
    """The latent ranks and the per-head dims of multi-head latent attention."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    q_lora_rank: PositiveInt | None = Field(
        default=None, description="rank of the query bottleneck (q_a_proj, q_a_layernorm, q_b_proj); None: a plain "
        "q_proj (DeepSeek-V2-Lite)")
    kv_lora_rank: PositiveInt = Field(description="rank of the shared key/value latent (kv_a_proj_with_mqa, "
                                      "kv_a_layernorm, kv_b_proj)")
    qk_nope_head_dim: PositiveInt = Field(description="each query/key head's part without positions")
    qk_rope_head_dim: PositiveInt = Field(description="each query/key head's rotary part (the key's is shared "
                                          "by every head)")
    v_head_dim: PositiveInt = Field(description="each value head's size (o_proj maps n_heads x v_head_dim -> d_model)")

    @model_validator(mode="after")
    def _even_rope(self) -> MlaConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"mla.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even: RoPE rotates pairs")
        return self

    @property
    def qk_head_dim(self) -> int:
        """Each query/key head's size: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


FILE_DEFAULTS: dict[Family, dict[str, Any]] = {Family.DEEPSEEK_V3: dict(DENSE_DEFAULTS[Family.LLAMA], norm_eps=1e-6)}
# multi-head latent attention and MoE MLPs: a model file of the family must have both sections
SECTIONS: dict[Family, tuple[str, ...]] = {Family.DEEPSEEK_V3: ("mla", "moe")}
