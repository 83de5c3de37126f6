"""Gemma's defaults for the fields a model file leaves out (transformers 5.24.0,
``models/gemma2/modeling_gemma2.py`` and ``models/gemma3/modeling_gemma3.py``): Gemma RMSNorm
before and after each branch, the GeGLU (tanh GELU) MLP, the embedding scaled by sqrt(D), tied
embeddings, no biases; Gemma 3 adds per-head q/k norms."""

from __future__ import annotations

from typing import Any

from planner.model.kinds import Activation, Family, MlpKind, NormKind, NormPlacement, PositionKind, QkNorm

_GEMMA: dict[str, Any] = dict(
    norm=NormKind.GEMMA_RMSNORM, norm_placement=NormPlacement.SANDWICH, mlp=MlpKind.GEGLU,
    activation=Activation.GELU_PYTORCH_TANH, positions=PositionKind.ROTARY, scale_embeddings=True,
    tie_embeddings=True, qkv_bias=False, attn_out_bias=False, mlp_bias=False, norm_bias=False, norm_eps=1e-6,
)
FILE_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.GEMMA2: _GEMMA,
    Family.GEMMA3_TEXT: dict(_GEMMA, qk_norm=QkNorm.HEAD),
}
SECTIONS: dict[Family, tuple[str, ...]] = {}
