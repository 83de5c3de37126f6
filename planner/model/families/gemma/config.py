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


def softcap_problems(attn_cap: float | None, final_cap: float | None, attention: str, loss: str,
                     implementation: str) -> list[str]:
    """Gemma 2's soft-capping, where it is priced: in the reference model, the attention scores'
    only as eager attention (PyTorch's SDPA has no soft-capping; transformers runs Gemma 2
    eagerly), the logits' only before the plain loss (the chunked and fused-linear losses never
    hold the whole logits)."""
    problems = []
    if (attn_cap is not None or final_cap is not None) and str(implementation) != "reference":
        problems.append(f"implementation: {implementation}'s soft-capping is not priced (the reference model runs "
                        "Gemma 2's); use implementation reference")
    if attn_cap is not None and str(attention) != "eager":
        problems.append(f"attn_logit_softcapping: {attn_cap}: PyTorch's SDPA has no soft-capping of the scores; use "
                        "--attention eager (attention: eager), as transformers runs Gemma 2")
    if final_cap is not None and str(loss) != "plain":
        problems.append(f"final_logit_softcapping: {final_cap}: the soft-capped logits are priced before the plain "
                        f"loss only, not the {loss} loss; use loss: plain")
    return problems
