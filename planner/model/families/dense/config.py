"""The dense families' defaults for the fields a model file leaves out: their published
architectures, GPT-2 and the Llama-shaped ones as transformers builds them
(``planner.model.families.registry`` gathers every family's)."""

from __future__ import annotations

from typing import Any

from planner.model.kinds import Family, MlpKind, NormKind, NormPlacement, PositionKind, QkNorm

FILE_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.GPT2: dict(
        norm=NormKind.LAYERNORM, mlp=MlpKind.GELU, positions=PositionKind.LEARNED,
        tie_embeddings=True, qkv_bias=True, attn_out_bias=True, mlp_bias=True, norm_bias=True, norm_eps=1e-5,
    ),
    Family.LLAMA: dict(
        norm=NormKind.RMSNORM, mlp=MlpKind.SWIGLU, positions=PositionKind.ROTARY,
        tie_embeddings=False, qkv_bias=False, attn_out_bias=False, mlp_bias=False, norm_bias=False, norm_eps=1e-5,
    ),
    Family.MISTRAL: dict(
        norm=NormKind.RMSNORM, mlp=MlpKind.SWIGLU, positions=PositionKind.ROTARY,
        tie_embeddings=False, qkv_bias=False, attn_out_bias=False, mlp_bias=False, norm_bias=False, norm_eps=1e-5,
    ),
    Family.QWEN2: dict(
        norm=NormKind.RMSNORM, mlp=MlpKind.SWIGLU, positions=PositionKind.ROTARY,
        tie_embeddings=False, qkv_bias=True, attn_out_bias=False, mlp_bias=False, norm_bias=False, norm_eps=1e-6,
    ),
}
FILE_DEFAULTS[Family.QWEN3] = dict(FILE_DEFAULTS[Family.QWEN2], qkv_bias=False, qk_norm=QkNorm.HEAD)
# Olmo2DecoderLayer: post_attention_layernorm / post_feedforward_layernorm on the branches' outputs
FILE_DEFAULTS[Family.OLMO2] = dict(FILE_DEFAULTS[Family.LLAMA], qk_norm=QkNorm.FULL,
                                   norm_placement=NormPlacement.POST)
# the dense families need no sub-config section (planner.model.families.registry)
SECTIONS: dict[Family, tuple[str, ...]] = {}
