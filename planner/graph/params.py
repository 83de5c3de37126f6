"""Parameter tensors of a ModelConfig, named as the reference model's state dict, from the one
model description (``planner.graph.blocks.describe``) the layer graph is built from.

Per block (Llama form): q (D x N*H), k and v (D x K*H), o (N*H x D), MLP up/down (and gate
for SwiGLU), two norms; plus the token embedding (V x D), learned positions if any, the final
norm and an untied LM head (V x D). GPT-2 small: 124,439,808; Llama-2-7B: 6,738,415,616.
"""

from __future__ import annotations

from planner.graph.blocks import describe
from planner.model.config import ModelConfig


def param_tensors(model: ModelConfig) -> dict[str, int]:
    """State-dict name -> element count, in registration order; a tied LM head is not listed twice."""
    return {name: p.numel for name, p in describe(model).params.items()}


def count_params(model: ModelConfig) -> int:
    """Total parameters (tied weights once), frozen ones included."""
    return sum(param_tensors(model).values())


def count_trainable_params(model: ModelConfig) -> int:
    """Parameters that train: all of them, or under ``model.finetune`` the adapters alone."""
    return sum(p.numel for p in describe(model).params.values() if not p.frozen)
