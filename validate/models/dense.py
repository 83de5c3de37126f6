"""The dense families' modules of the reference model (``validate.reference_model`` builds every
block from them, MoE and MLA blocks from ``validate.models.moe`` and ``validate.models.deepseek``):
grouped-query attention with its optional q/k norms, the dense MLP, and the transformers config
of each family implementation hf runs (``HF_CONFIGS``).

Modules are named as the planner names their ops (``planner.graph.blocks``) and register in the
order they run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from einops import rearrange
from torch import nn

from hardware.errors import ConfigError
from planner.model.config import (
    Family,
    MlpKind,
    ModelConfig,
    NormKind,
    PositionKind,
    QkNorm,
    effective_activation,
)


class Fp32RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight (transformers' Qwen3/OLMoE
    RMSNorm, used on q and k): ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (transformers 5.24.0 ``Gemma3RMSNorm``/``Gemma2RMSNorm``): in fp32, times
    ``1 + w`` in fp32 (the weight starts at zero), cast back: ``planner.ops.gemma``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normed(x.float()).mul(1.0 + self.weight.float()).type_as(x)

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft-capping ``cap * tanh(x / cap)``, written as transformers 5.24.0 runs it
    (``models/gemma2/modeling_gemma2.py``: the eager attention scores before the mask, the logits
    before the loss): three ops of x's dtype, each result replacing the last (only tanh's output
    is saved for backward): ``planner.ops.gemma``."""
    x = x / cap
    x = torch.tanh(x)
    return x * cap


class Attention(nn.Module):
    """Multi-head (grouped-query) attention: q, k, v (q/k normed: Qwen3, OLMo 2, OLMoE), rotary,
    the core, o_proj. The core and the rotary module are the reference model's (``core_type``,
    ``rotary_type``), built in their place in the registration order."""

    def __init__(self, config: ModelConfig, core_type: Callable[[ModelConfig], nn.Module],
                 rotary_type: Callable[[], nn.Module]) -> None:
        super().__init__()
        n, k, h, d = config.n_heads, config.kv_heads, config.head_dim, config.d_model
        self.head_dim = h
        eps = float(config.norm_eps or 1e-6)
        # Phi-3 (transformers 5.24.0 Phi3Attention): one qkv_proj, its output sliced into q, k, v views
        self.qkv_widths = (n * h, k * h, k * h) if config.fused_projections else None
        if self.qkv_widths is not None:
            self.qkv_proj = nn.Linear(d, (n + 2 * k) * h, bias=bool(config.qkv_bias))
            self.q_norm: nn.Module | None = None
            self.k_norm: nn.Module | None = None
            self.qk_per_head = False
        else:
            self._separate_projections(config, eps)
        self.rotary = rotary_type() if config.positions is PositionKind.ROTARY else None
        self.core = core_type(config)
        self.o_proj = nn.Linear(n * h, d, bias=bool(config.attn_out_bias))

    def _separate_projections(self, config: ModelConfig, eps: float) -> None:
        """q_proj, [q_norm], k_proj, [k_norm], v_proj, registered in that order."""
        n, k, h, d = config.n_heads, config.kv_heads, config.head_dim, config.d_model
        self.q_proj = nn.Linear(d, n * h, bias=bool(config.qkv_bias))
        # q/k norms (Qwen3: over each head's H; OLMoE: over all heads) in fp32, before rotary
        qk = config.qk_norm or QkNorm.NONE
        norm_type = GemmaRMSNorm if config.norm is NormKind.GEMMA_RMSNORM else Fp32RMSNorm  # Gemma 3's q/k norms
        self.q_norm = norm_type(h if qk is QkNorm.HEAD else n * h, eps) if qk is not QkNorm.NONE else None
        self.k_proj = nn.Linear(d, k * h, bias=bool(config.qkv_bias))
        self.k_norm = norm_type(h if qk is QkNorm.HEAD else k * h, eps) if qk is not QkNorm.NONE else None
        self.qk_per_head = qk is QkNorm.HEAD
        self.v_proj = nn.Linear(d, k * h, bias=bool(config.qkv_bias))

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, N, T, H), k and v (B, K, T, H), with rotary applied to q and k."""
        split = "b t (n h) -> b n t h"
        if self.qkv_widths is not None:
            q, k, v = (rearrange(part, split, h=self.head_dim) for part in self._fused(self.qkv_proj(x)))
            return self.rotary(q, k, *rope) + (v,) if self.rotary is not None and rope is not None else (q, k, v)
        q = rearrange(self._normed(self.q_proj(x), self.q_norm), split, h=self.head_dim)
        k = rearrange(self._normed(self.k_proj(x), self.k_norm), split, h=self.head_dim)
        v = rearrange(self.v_proj(x), split, h=self.head_dim)
        if self.rotary is not None and rope is not None:
            q, k = self.rotary(q, k, *rope)
        return q, k, v

    def _fused(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: column slices of the one qkv_proj output (views, as Phi3Attention slices them)."""
        nq, nk, _ = self.qkv_widths or (0, 0, 0)
        return qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]

    def _normed(self, x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        """``x`` (B, T, heads H) through the q/k norm, over each head or over all of them."""
        if norm is None:
            return x
        if self.qk_per_head:
            return norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return norm(x)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q, k, v go straight into the core: no local keeps them alive during o_proj
        return self.o_proj(self.core(*self.project(x, rope), mask))


class Mlp(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f, bias = config.d_model, config.d_ff, bool(config.mlp_bias)
        self.kind = config.mlp
        self.fused = bool(config.fused_projections)  # Phi3MLP: one gate_up_proj, its output halved into views
        if self.fused:
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=bias)
        gated = self.kind in (MlpKind.SWIGLU, MlpKind.GEGLU)  # GeGLU (Gemma): the tanh GELU of the gate
        self.gate_proj: nn.Module | None = nn.Linear(d, f, bias=bias) if gated and not self.fused else None
        self.up_proj: nn.Module | None = None if self.fused else nn.Linear(d, f, bias=bias)
        self.act = nn.SiLU() if self.kind is MlpKind.SWIGLU else nn.GELU(approximate="tanh")
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(self._glu(self.gate_up_proj(x)))
        assert self.up_proj is not None  # set whenever the projections are separate
        if self.gate_proj is not None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))

    def _glu(self, fused: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the halves of the one gate_up_proj output (views; the argument keeps it until the product)."""
        f = fused.shape[-1] // 2
        return self.act(fused[..., :f]) * fused[..., f:]


def _common(model: ModelConfig) -> dict[str, Any]:
    return dict(vocab_size=model.vocab_size, tie_word_embeddings=bool(model.tie_embeddings), use_cache=False)


def _gpt2(model: ModelConfig) -> Any:
    import transformers

    act = effective_activation(model)
    return transformers.GPT2Config(
        n_layer=model.n_layers, n_embd=model.d_model, n_head=model.n_heads, n_inner=model.d_ff,
        n_positions=model.position_rows, layer_norm_epsilon=model.norm_eps or 1e-5,
        activation_function=act.value, resid_pdrop=model.dropout, embd_pdrop=model.dropout,
        attn_pdrop=model.dropout, **_common(model))


def _gated(model: ModelConfig) -> dict[str, Any]:
    """The arguments every Llama-like transformers config takes (a refusal if the model is not Llama-like)."""
    if (model.mlp, model.positions, model.norm) != (MlpKind.SWIGLU, PositionKind.ROTARY, NormKind.RMSNORM):
        raise ConfigError(f"model: transformers' {model.family.value} runs a SwiGLU MLP, rotary positions and "
                          "RMSNorm; this model differs (mlp/positions/norm); use implementation: reference")
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    return dict(hidden_size=model.d_model, intermediate_size=model.d_ff, num_hidden_layers=model.n_layers,
                num_attention_heads=model.n_heads, num_key_value_heads=model.kv_heads,
                max_position_embeddings=model.max_seq_len or 4096, rms_norm_eps=model.norm_eps or 1e-6,
                rope_parameters=rope, attention_dropout=model.dropout, head_dim=model.head_dim, **_common(model))


def _llama(model: ModelConfig) -> Any:
    import transformers

    args = _gated(model)
    if bool(model.qkv_bias) != bool(model.attn_out_bias):
        raise ConfigError("model: transformers' Llama has one attention_bias for q/k/v and o_proj; set qkv_bias "
                          "and attn_out_bias alike")
    return transformers.LlamaConfig(attention_bias=bool(model.qkv_bias), mlp_bias=bool(model.mlp_bias), **args)


def _check_biases(model: ModelConfig) -> None:
    """Mistral has no biases, Qwen2 q/k/v biases only."""
    if model.mlp_bias or model.attn_out_bias or bool(model.qkv_bias) != (model.family is Family.QWEN2):
        raise ConfigError(f"model: transformers' {model.family.value} has {'q/k/v biases' if model.family is Family.QWEN2 else 'no biases'} "
                          "only; change qkv_bias/attn_out_bias/mlp_bias to match or use implementation: reference")


def _mistral(model: ModelConfig) -> Any:
    import transformers

    args = _gated(model)
    _check_biases(model)
    return transformers.MistralConfig(sliding_window=model.sliding_window, **args)  # every layer slides when set


def _qwen2(model: ModelConfig) -> Any:
    import transformers

    args = _gated(model)
    _check_biases(model)
    layer_types = [("sliding_attention" if model.window(b) is not None else "full_attention")
                   for b in range(model.n_layers)]
    return transformers.Qwen2Config(use_sliding_window=model.sliding_window is not None,
                                    sliding_window=model.sliding_window, layer_types=layer_types, **args)


# The transformers config of each family implementation hf runs (transformers 5.24.0's
# GPT2Config, LlamaConfig, MistralConfig, Qwen2Config; planner.model.kinds.HF_FAMILIES): one line
# naming the field for what the class cannot express. A family priced under implementation hf
# registers its builder here.
HF_CONFIGS: dict[Family, Callable[[ModelConfig], Any]] = {
    Family.GPT2: _gpt2, Family.LLAMA: _llama, Family.MISTRAL: _mistral, Family.QWEN2: _qwen2,
}
