"""gpt-oss's own module of the reference model: its experts' clamped SwiGLU (``validate.models.moe``
runs the experts; its attention sinks are ``validate.reference_model.AttentionCore``'s, its
top-k-then-softmax router ``validate.models.moe.MoE.route``'s).
"""

from __future__ import annotations

import torch
from torch import nn


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation over interleaved (gate, up) columns, as transformers 5.24.0's
    ``GptOssExperts._apply_gate``: gate clamped above at ``limit``, up to [-limit, limit],
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu
