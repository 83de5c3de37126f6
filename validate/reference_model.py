"""The reference model: plain, readable PyTorch (with einops) built from a ``ModelConfig``. This
module holds what every family shares (norms, dropout, rotary, the attention core, the block, the
model); each family's own modules are in ``validate.models`` (``dense``: attention and MLP;
``moe``; ``deepseek``: multi-head latent attention; ``gpt_oss``).

Every op the planner prices is a module here, and module names are the planner's graph node
names (``blocks.3.attn.q_proj``), so predicted and measured per-module figures join on one key.
``model(input_ids, targets)`` returns the scalar mean cross-entropy loss.

Memory-relevant choices are deliberate and mirrored by the planner's cost formulas:
- RMSNorm is written out (``x * rsqrt(mean(x^2) + eps) * w``) so it saves the same tensors on
  every device (``F.rms_norm`` is fused on CUDA but decomposed on CPU);
- the causal mask (eager attention) and the rotary cos/sin tables are built once per forward
  and shared by every block, as transformers does;
- the loss upcasts the logits to fp32 before the cross-entropy (a no-op in fp32);
- dropout calls ``torch.native_dropout`` (a bool mask, as CUDA's ``F.dropout`` does; on CPU
  ``F.dropout`` saves a float noise tensor instead);
- forwards are written as chained expressions or rebind one name, so no Python local keeps a
  tensor alive longer than autograd does (a local holds its tensor until the function returns).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from planner.model.config import AttentionImpl, ModelConfig, NormKind, NormPlacement, PositionKind
from validate.models.deepseek import MlaAttention
from validate.models.dense import Attention, GemmaRMSNorm, Mlp, softcap
from validate.models.llama4 import Llama4Attention
from validate.models.moe import MoE


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * rstd) * self.weight


def make_norm(config: ModelConfig) -> nn.Module:
    eps = float(config.norm_eps or 1e-5)
    if config.norm is NormKind.RMSNORM:
        return RMSNorm(config.d_model, eps)
    if config.norm is NormKind.GEMMA_RMSNORM:
        return GemmaRMSNorm(config.d_model, eps)
    return nn.LayerNorm(config.d_model, eps=eps, bias=bool(config.norm_bias))


class Dropout(nn.Module):
    """Dropout through ``native_dropout``: the same memory (a bool mask) on every device."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, self.training)[0] if self.training and self.p > 0 else x


class Rotary(nn.Module):
    """RoPE (Su et al. 2021), rotate-half form as in transformers' Llama: x*cos + rot(x)*sin."""

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # no-op unless autocast made q low precision
        rotated = cos.shape[-1]
        if rotated < q.shape[-1]:  # partial rotary (Phi-3's apply_rotary_pos_emb): the rest passes through
            return (torch.cat((self._rotated(q[..., :rotated], cos, sin), q[..., rotated:]), dim=-1),
                    torch.cat((self._rotated(k[..., :rotated], cos, sin), k[..., rotated:]), dim=-1))
        return self._rotated(q, cos, sin), self._rotated(k, cos, sin)

    def _rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + self._rotate_half(x) * sin


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(H) + causal) v over heads; returns (B, T, N*H)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.impl = config.attention
        self.dropout = config.dropout
        self.groups = config.n_heads // config.kv_heads
        # Gemma: query_pre_attn_scalar^-0.5 (transformers' Gemma2/Gemma3Attention.scaling)
        self.scale = 1.0 / math.sqrt(config.query_pre_attn_scalar or config.head_dim)
        self.sdpa_scale = self.scale if config.query_pre_attn_scalar else None  # None: SDPA's 1/sqrt(q's head dim)
        self.softcap = config.attn_logit_softcapping  # Gemma 2: c tanh(s / c) of the eager scores, before the mask
        # gpt-oss's attention sinks: a learned logit per head, a column beside every row of scores
        self.sinks = nn.Parameter(torch.empty(config.n_heads)) if config.attention_sinks else None
        if self.sinks is not None and self.sinks.device.type != "meta":
            nn.init.normal_(self.sinks, mean=0.0, std=0.02)
        self.checkpointed = False  # Korthikanti's selective recompute: this core alone under checkpoint
        # query/key and value head dims differ (MLA): a GPU's SDPA runs the memory-efficient kernel
        # (flash needs equal dims); the CPU's falls back to the math kernel. Simulations set this to
        # call the memory-efficient kernel's op directly (its fake kernel runs on any device)
        self.dims_differ = config.mla is not None and config.mla.qk_head_dim != config.mla.v_head_dim
        self.efficient_kernel = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._attend, q, k, v, mask, use_reentrant=False)
        return self._attend(q, k, v, mask)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        p_drop = self.dropout if self.training else 0.0
        if self.impl is AttentionImpl.FLASH and self.efficient_kernel and self.dims_differ and not p_drop:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, q.requires_grad, 0.0, True)[0]
        elif self.impl is AttentionImpl.FLASH:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p_drop, is_causal=True, enable_gqa=self.groups > 1, scale=self.sdpa_scale
            )
        else:
            if self.groups > 1:
                k = repeat(k, "b k t h -> b (k g) t h", g=self.groups)
                v = repeat(v, "b k t h -> b (k g) t h", g=self.groups)
            if mask is None:
                raise ValueError("eager attention needs the causal mask")
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
            if self.softcap is not None:
                scores = softcap(scores, self.softcap)
            scores = scores.masked_fill(mask, float("-inf"))
            if self.sinks is not None:  # the sink column joins each row (transformers' gpt-oss eager attention)
                b, n, t, _ = scores.shape
                scores = torch.cat([scores, self.sinks.to(scores.dtype).view(1, n, 1, 1).expand(b, n, t, 1)], dim=-1)
            if torch.is_autocast_enabled(q.device.type):
                # CUDA autocast runs softmax in fp32 (CPU autocast does not): do it explicitly
                scores = self._unsunk(torch.softmax(scores, dim=-1, dtype=torch.float32)).to(q.dtype)
            else:
                scores = self._unsunk(torch.softmax(scores, dim=-1))
            if p_drop > 0:
                scores = torch.native_dropout(scores, p_drop, True)[0]
            out = torch.matmul(scores, v)
        return rearrange(out, "b n t h -> b t (n h)")

    def _unsunk(self, probs: torch.Tensor) -> torch.Tensor:
        """The probabilities without the sink's column (a view)."""
        return probs if self.sinks is None else probs[..., :-1]


class Block(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))); post-norm (OLMo 2):
    x + norm(drop(attn(x))), then x + norm(drop(mlp(x))). Modules register in execution order."""

    def __init__(self, config: ModelConfig, index: int = 0, ep: int = 1) -> None:
        super().__init__()
        self.post = config.norm_placement is NormPlacement.POST
        if not self.post:
            self.attn_norm = make_norm(config)
        self.attn: nn.Module = (MlaAttention(config, AttentionCore(config), Rotary()) if config.mla
                                else Llama4Attention(config, index, AttentionCore, Rotary) if config.llama4
                                else Attention(config, AttentionCore, Rotary))
        self.attn_dropout = Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        if self.post:
            self.attn_norm = make_norm(config)
        # Gemma (NormPlacement.SANDWICH): each branch also normed on its way out, before its residual add
        self.sandwich = config.norm_placement is NormPlacement.SANDWICH
        if self.sandwich:
            self.attn_post_norm = make_norm(config)
        self.windowed = config.window(index) is not None  # takes the sliding-window mask
        sparse = config.moe is not None and config.moe.is_sparse(index)
        if not self.post:
            self.mlp_norm = make_norm(config)
        self.mlp: nn.Module = MoE(config.moe, config.d_model, ep) if sparse and config.moe else Mlp(config)
        self.mlp_dropout = Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        if self.post:
            self.mlp_norm = make_norm(config)
        if self.sandwich:
            self.mlp_post_norm = make_norm(config)
        self.local_rope = config.local_rope and self.windowed  # the sliding blocks' tables (Gemma 3)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...] | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if rope is not None:  # (cos, sin), or (cos, sin, local cos, local sin) with a local base
            rope = (rope[2], rope[3]) if self.local_rope else (rope[0], rope[1])
        if self.sandwich:  # Gemma2/Gemma3DecoderLayer: the branch's post norm takes its output as it is
            x = x + self.attn_post_norm(self.attn_dropout(self.attn(self.attn_norm(x), rope, mask)))
            return x + self.mlp_post_norm(self.mlp_dropout(self.mlp(self.mlp_norm(x))))
        if self.post:  # each branch normed in the stream's dtype (a copy under autocast: fp32 stream)
            x = x + self.attn_norm(self.attn_dropout(self.attn(x, rope, mask)).to(x.dtype))
            return x + self.mlp_norm(self.mlp_dropout(self.mlp(x)).to(x.dtype))
        x = x + self.attn_dropout(self.attn(self.attn_norm(x), rope, mask))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation (Radford et al. 2019; nanoGPT): weights N(0, 0.02), biases zero.

    torch's default N(0, 1) embedding gives logits with a standard deviation near sqrt(D); their
    softmax gradients then underflow to denormals, on which CPU matmuls run ~100x slower.
    """
    if isinstance(module, nn.Linear | nn.Embedding):
        if module.weight.device.type != "meta":
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None and module.bias.device.type != "meta":
            nn.init.zeros_(module.bias)


def _rope_pair(h: int, positions: torch.Tensor, dtype: torch.dtype, theta: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, h) of base ``theta`` at ``positions``, in fp32, cast to ``dtype``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, h, 2, device=positions.device, dtype=torch.float32) / h))
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Transformer(nn.Module):
    """Decoder-only LM: embed (+ learned positions), L blocks, final norm, LM head, loss."""

    def __init__(self, config: ModelConfig, ep: int = 1) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        learned = config.positions is PositionKind.LEARNED
        self.pos_embed = nn.Embedding(config.position_rows, config.d_model) if learned else None
        self.embed_dropout = Dropout(config.dropout) if config.dropout > 0 else None
        self.blocks = nn.ModuleList(Block(config, i, ep) for i in range(config.n_layers))
        self.final_norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(_init_weights)
        # Checkpoint units (first, last): blocks first..last run under one non-reentrant
        # torch.utils.checkpoint; set by the plan (see ``set_checkpointing``), with
        # ``checkpoint_contexts[first]`` as its context_fn (per-op selective checkpointing) if set.
        self.checkpoint_units: tuple[tuple[int, int], ...] = ()
        self.checkpoint_contexts: dict[int, Callable[[], Any]] = {}

    @property
    def checkpoint_blocks(self) -> frozenset[int]:
        return frozenset(b for first, last in self.checkpoint_units for b in range(first, last + 1))

    @checkpoint_blocks.setter
    def checkpoint_blocks(self, blocks: frozenset[int]) -> None:
        self.set_checkpointing(blocks, ())

    def set_checkpointing(self, blocks: frozenset[int] | tuple[int, ...], segments: tuple[tuple[int, int], ...]) -> None:
        """Checkpoint each of ``blocks`` alone and each (first, last) segment as one unit."""
        self.checkpoint_units = tuple(sorted({(b, b) for b in blocks} | set(segments)))

    def _run_blocks(
        self, first: int, last: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
        masks: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> torch.Tensor:
        for index in range(first, last + 1):
            block = self.blocks[index]
            x = block(x, rope, masks[1] if block.windowed else masks[0])
        return x

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin of shape (T, H) at ``positions`` (fp32, the tokens' places in their
        sequence), built once per forward in fp32 and cast to the activations' dtype; then the
        sliding blocks' own pair where they have a base of their own (Gemma 3's local base)."""
        tables: tuple[torch.Tensor, ...] = _rope_pair(self.config.rope_dim, positions, dtype, self.config.rope_theta)
        if self.config.local_rope and self.config.rope_local_theta is not None:
            tables += _rope_pair(self.config.rope_dim, positions, dtype, self.config.rope_local_theta)
        return tables

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The mean cross-entropy of ``input_ids`` predicting ``targets``. ``positions`` (fp32, one
        per token) places the tokens in their sequence; default ``0..T-1``. Under context
        parallelism a rank holds two chunks of every sequence (torch's head-tail load balancing)
        and passes their positions."""
        seq_len = input_ids.shape[1]
        moes = [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]
        aux_losses: list[torch.Tensor] = []  # scalars: nothing big stays alive with them
        for moe in moes:
            moe.aux_sink = aux_losses
        x = self.embed(input_ids)
        if self.config.scale_embeddings:  # Gemma's scaled word embedding: times sqrt(D)
            x = x * self.config.d_model ** 0.5
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(seq_len, device=input_ids.device))
        if self.embed_dropout is not None:
            x = self.embed_dropout(x)
        rope = None
        if self.config.positions is PositionKind.ROTARY:  # default positions: a temporary, not a local
            rope = self.rope_tables(torch.arange(seq_len, device=x.device, dtype=torch.float32) if positions is None
                                    else positions, x.dtype)
        causal = window = None
        if self.config.attention is AttentionImpl.EAGER:
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1)
            if any(block.windowed for block in self.blocks) and self.config.sliding_window is not None:
                # sliding layers: key j seen by query i iff i - window < j <= i (transformers' sliding mask)
                window = causal | torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).tril(
                    -self.config.sliding_window)
        units = {first: last for first, last in self.checkpoint_units}
        index = 0
        while index < len(self.blocks):
            if index in units:
                last = units[index]
                # a checkpoint keeps its arguments until its backward: only the masks its blocks take
                windowed = [self.blocks[i].windowed for i in range(index, last + 1)]
                masks = (causal if not all(windowed) else None, window if any(windowed) else None)
                context = self.checkpoint_contexts.get(index)
                if context is not None:
                    x = torch.utils.checkpoint.checkpoint(self._run_blocks, index, last, x, rope, masks,
                                                          use_reentrant=False, context_fn=context)
                else:
                    x = torch.utils.checkpoint.checkpoint(self._run_blocks, index, last, x, rope, masks,
                                                          use_reentrant=False)
                index = last + 1
            else:
                x = self._run_blocks(index, index, x, rope, (causal, window))
                index += 1
        # one expression: the low-precision logits are freed as soon as their fp32 copy exists
        loss = F.cross_entropy(self._logits(x).float().flatten(0, 1), targets.flatten())
        for moe in moes:
            moe.aux_sink = None
        return sum(aux_losses, loss)  # the MoE blocks' load-balancing losses, if any


    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of the final hidden states, soft-capped where the model caps them
        (Gemma 2's ``final_logit_softcapping``: ``c * tanh(z / c)``, ``Gemma2ForCausalLM.forward``)."""
        cap = self.config.final_logit_softcapping
        if cap is None:
            return self.lm_head(self.final_norm(x))
        return softcap(self.lm_head(self.final_norm(x)), cap)  # z dies at its division, as transformers' rebinding


def build_model(config: ModelConfig, dtype: torch.dtype | None = None, ep: int = 1) -> Transformer:
    """The reference ``torch.nn.Module`` for ``config``, parameters created in ``dtype`` (with
    ``ep`` > 1: one expert-parallel rank's, holding E/ep experts of each MoE block).

    Parameters are created directly in ``dtype`` (not converted afterwards with ``.to``), which
    also works under ``FakeTensorMode`` where conversion cannot swap fake parameters.
    """
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        return Transformer(config, ep)
    finally:
        torch.set_default_dtype(previous)
