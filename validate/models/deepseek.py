"""The reference model's multi-head latent attention (``ModelConfig.mla``; DeepSeek-V2/V3).

Written after transformers 5.24.0's ``DeepseekV3Attention`` (modeling_deepseek_v3.py), op for op
where it matters for memory: the query through its low-rank bottleneck (or a plain ``q_proj``),
the shared latent ``kv_a_proj_with_mqa`` split into the latent (normed, expanded per head by
``kv_b_proj``) and one rotary key; rotary on the rope parts only; q and k concatenated from their
nope and rope parts (the rotary key expanded over the heads: a view); values a view of
``kv_b_proj``'s output; fused attention with query/key head dim nope + rope and value head dim
``v_head_dim``; ``o_proj`` from N v. Differences from transformers, none changing FLOPs: the key
is built by ``torch.cat`` (transformers copies the two parts into a ``new_empty`` tensor), the
rotary embedding is the rotate-half form (``rope_interleave`` false; interleaving is a weight
layout), and the softmax scale is SDPA's default 1/sqrt(nope + rope) (DeepSeek's yarn mscale only
rescales it). The planner describes the same ops (``planner.model.families.deepseek.blocks``).
"""

from __future__ import annotations

import torch
from torch import nn

from planner.model.config import ModelConfig
from validate.models.dense import Fp32RMSNorm

# transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm do not take rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    """Multi-head latent attention; input (B, T, D), output (B, T, D)."""

    def __init__(self, config: ModelConfig, core: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        n, d = config.n_heads, config.d_model
        self.n_heads, self.mla = n, mla
        bias = bool(config.qkv_bias)  # DeepSeek's attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        if mla.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(d, n * mla.qk_head_dim, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = Fp32RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, n * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = Fp32RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.rotary = rotary
        self.core = core
        self.o_proj = nn.Linear(n * mla.v_head_dim, d, bias=bool(config.attn_out_bias))

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k (B, N, T, nope + rope), v (B, N, T, v_head_dim: a view of kv_b_proj's output)."""
        assert rope is not None
        b, t, _ = x.shape
        m, n = self.mla, self.n_heads
        nope, r = m.qk_nope_head_dim, m.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, n, m.qk_head_dim).transpose(1, 2)
        latent = self.kv_a_proj_with_mqa(x)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent[..., :r])).view(b, t, n, nope + m.v_head_dim).transpose(1, 2)
        q_rot, k_rot = self.rotary(q[..., nope:], latent[..., r:].unsqueeze(1), *rope)
        return (torch.cat((q[..., :nope], q_rot), dim=-1),
                torch.cat((kv[..., :nope], k_rot.expand(-1, n, -1, -1)), dim=-1),
                kv[..., nope:])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        return self.o_proj(self.core(*self.project(x, rope), mask))
