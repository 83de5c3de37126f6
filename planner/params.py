"""Parameter tensors of a ModelConfig, named as the reference model's state dict.

Per block (Llama form): q (D x N*H), k and v (D x K*H), o (N*H x D), MLP up/down (and gate
for SwiGLU), two norms; plus the token embedding (V x D), learned positions if any, the final
norm and an untied LM head (V x D). GPT-2 small: 124,439,808; Llama-2-7B: 6,738,415,616.
"""

from __future__ import annotations

from planner.config import MlpKind, ModelConfig, NormKind, PositionKind


def param_tensors(model: ModelConfig) -> dict[str, int]:
    """State-dict name -> element count; a tied LM head is not listed twice."""
    m = model
    d, h = m.d_model, m.head_dim
    tensors: dict[str, int] = {"embed.weight": m.vocab_size * d}
    if m.positions is PositionKind.LEARNED:
        tensors["pos_embed.weight"] = m.position_rows * d

    def norm(prefix: str) -> None:
        tensors[f"{prefix}.weight"] = d
        if m.norm is NormKind.LAYERNORM and m.norm_bias:
            tensors[f"{prefix}.bias"] = d

    def linear(prefix: str, i: int, o: int, bias: bool | None) -> None:
        tensors[f"{prefix}.weight"] = i * o
        if bias:
            tensors[f"{prefix}.bias"] = o

    for b in range(m.n_layers):
        p = f"blocks.{b}"
        norm(f"{p}.attn_norm")
        linear(f"{p}.attn.q_proj", d, m.n_heads * h, m.qkv_bias)
        linear(f"{p}.attn.k_proj", d, m.kv_heads * h, m.qkv_bias)
        linear(f"{p}.attn.v_proj", d, m.kv_heads * h, m.qkv_bias)
        linear(f"{p}.attn.o_proj", m.n_heads * h, d, m.attn_out_bias)
        norm(f"{p}.mlp_norm")
        if m.mlp is MlpKind.SWIGLU:
            linear(f"{p}.mlp.gate_proj", d, m.d_ff, m.mlp_bias)
        linear(f"{p}.mlp.up_proj", d, m.d_ff, m.mlp_bias)
        linear(f"{p}.mlp.down_proj", m.d_ff, d, m.mlp_bias)
    norm("final_norm")
    if not m.tie_embeddings:
        tensors["lm_head.weight"] = m.vocab_size * d
    return tensors


def count_params(model: ModelConfig) -> int:
    """Total trainable parameters (tied weights once)."""
    return sum(param_tensors(model).values())
