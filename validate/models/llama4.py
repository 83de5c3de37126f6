"""Llama 4's attention in the reference model (``ModelConfig.llama4``), as transformers 5.24.0's
``models/llama4/modeling_llama4.py`` ``Llama4TextAttention`` runs it around the shared core: RoPE
on the RoPE blocks only, then there the weightless L2 norm of q and k (``Llama4TextL2Norm``); on
the no-RoPE blocks the per-position temperature of q (``attn_temperature_tuning``). Its MoE block
is ``validate.models.moe.MoE`` with ``RouterScoring.TOPK_SIGMOID``.

The planner's ops for these modules are ``planner.model.families.llama4.blocks`` (names) and
``planner.ops.llama4`` (costs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange
from torch import nn

from planner.model.config import ModelConfig
from validate.models.dense import Attention


class L2Norm(nn.Module):
    """``Llama4TextL2Norm``: ``(x.float() * rsqrt(mean(x^2) + eps)).type_as(x)`` over the last dim,
    no weight; applied to q, then to k."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm(q), self._norm(k)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class Temperature(nn.Module):
    """Attention temperature tuning of the no-RoPE blocks: q (B, N, T, H) times
    ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (fp32, one per position), cast back."""

    def __init__(self, floor_scale: int, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = floor_scale, attn_scale

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        positions = torch.arange(t, device=q.device)
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (q * scales.view(1, 1, t, 1)).to(q.dtype)


class Llama4Attention(Attention):
    """Grouped-query attention of block ``index``: q, k, v; [rotary, L2 norm] or [temperature];
    the core; o_proj."""

    def __init__(self, config: ModelConfig, index: int, core_type: Callable[[ModelConfig], nn.Module],
                 rotary_type: Callable[[], nn.Module]) -> None:
        super().__init__(config, core_type, rotary_type)
        settings = config.llama4
        assert settings is not None, "Llama4Attention needs ModelConfig.llama4"
        self.rotates = settings.rotary(index)
        eps = float(config.norm_eps or 1e-5)
        self.qk_l2_norm = L2Norm(eps) if self.rotates and settings.qk_l2_norm else None
        self.temperature = (Temperature(settings.floor_scale, settings.attn_scale)
                            if not self.rotates and settings.temperature_tuning else None)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        split = "b t (n h) -> b n t h"
        q = rearrange(self.q_proj(x), split, h=self.head_dim)
        k = rearrange(self.k_proj(x), split, h=self.head_dim)
        v = rearrange(self.v_proj(x), split, h=self.head_dim)
        if self.rotates and self.rotary is not None and rope is not None:
            q, k = self.rotary(q, k, *rope)
        if self.qk_l2_norm is not None:
            q, k = self.qk_l2_norm(q, k)
        if self.temperature is not None:
            q = self.temperature(q)
        return q, k, v
