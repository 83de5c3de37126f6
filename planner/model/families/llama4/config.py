"""Llama 4's attention settings (``ModelConfig.llama4``), in transformers' vocabulary, and the
family's defaults for the fields a model file leaves out.

Mapped from transformers 5.24.0's ``models/llama4/modeling_llama4.py`` (``Llama4TextAttention``):

- ``nope_layers``: the blocks whose attention takes no rotary positions (``no_rope_layers[i]``
  is 0; the default ``Llama4TextConfig`` makes every ``no_rope_layer_interval``-th block one);
- ``qk_l2_norm`` (``use_qk_norm``): on the RoPE blocks only, ``Llama4TextL2Norm`` (no weight:
  ``x.float() * rsqrt(mean(x^2) + eps)``, cast back) over each head's H values of q and k,
  after the rotary;
- ``temperature_tuning`` (``attn_temperature_tuning``): on the no-RoPE blocks only, q times
  ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` per position (an fp32 (T,) scale:
  q is promoted to fp32 by the product and cast back);
- ``attention_chunk_size``: the RoPE blocks attend within chunks of that many tokens (query i
  sees key j iff j <= i and i // chunk == j // chunk; ``create_chunked_causal_mask``). At a
  sequence of at most one chunk that is the causal mask: exact as plain causal attention; past
  it the planner refuses (``ModelConfig.window_refusal``), naming the key.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from planner.model.families.dense.config import FILE_DEFAULTS as DENSE_DEFAULTS
from planner.model.kinds import Family


class Llama4Config(BaseModel):
    """Which blocks rotate q and k, and what Llama 4's attention does around its core."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nope_layers: tuple[NonNegativeInt, ...] = Field(
        default=(), description="blocks whose attention has no rotary positions (transformers' no_rope_layers "
        "entries that are 0); the others rotate q and k")
    qk_l2_norm: bool = Field(default=True, description="a weightless L2 (RMS) norm of q and k per head, in fp32, "
                             "after the rotary, on the RoPE blocks (use_qk_norm)")
    temperature_tuning: bool = Field(default=True, description="q scaled per position on the no-RoPE blocks "
                                     "(attn_temperature_tuning: log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1)")
    floor_scale: PositiveInt = Field(default=8192, description="temperature tuning's floor_scale")
    attn_scale: float = Field(default=0.1, description="temperature tuning's attn_scale")
    attention_chunk_size: PositiveInt | None = Field(
        default=None, description="the RoPE blocks attend within chunks of this many tokens (chunked local "
        "attention); priced up to one chunk (then it is causal attention), refused past it; None: causal")

    def rotary(self, block: int) -> bool:
        """Whether block ``block`` rotates q and k."""
        return block not in self.nope_layers

    def chunk_refusal(self, seq_len: int) -> str | None:
        """One line when chunked attention would mask something at ``seq_len`` (past one chunk)."""
        chunk = self.attention_chunk_size
        if chunk is None or seq_len <= chunk:
            return None
        return (f"attention_chunk_size: the RoPE blocks attend within chunks of {chunk} tokens, below training.seq_len "
                f"{seq_len}; chunked local attention past one chunk (a block-diagonal causal mask) is not priced yet; "
                f"plan --seq-len {chunk} or less")


# Llama4TextDecoderLayer: Llama's pre-norm block (RMSNorm, SwiGLU dense MLPs, no biases by default)
FILE_DEFAULTS: dict[Family, dict[str, Any]] = {Family.LLAMA4_TEXT: dict(DENSE_DEFAULTS[Family.LLAMA])}
SECTIONS: dict[Family, tuple[str, ...]] = {Family.LLAMA4_TEXT: ("moe",)}
