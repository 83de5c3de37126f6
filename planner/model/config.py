"""What is trained (ModelConfig) and how (TrainConfig): frozen, validated, documented fields.

Field names follow the transformers/torchtitan vocabulary; every size is validated here so a
bad file fails with the field's name rather than deep inside a formula.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from hardware.kernels import AttentionKernel
from hardware.stack import DEFAULT_STACK, Stack
from planner.finetune.config import FinetuneConfig
from planner.model.checks import shape_problems, with_family_defaults
from planner.model.families.deepseek.config import MlaConfig
from planner.model.families.gemma.config import softcap_problems
from planner.model.families.llama4.config import Llama4Config
from planner.model.families.moe.config import MoeConfig
from planner.model.families.registry import MOE_FAMILIES
from planner.model.kinds import (
    IMPLEMENTATION_GPT2_ACTIVATION,
    IMPLEMENTATION_LOSS,
    TORCHTITAN_LOSS_CHUNKS,
    Activation,
    AttentionImpl,
    Family,
    Implementation,
    LayerType,
    LossKind,
    MlpKind,
    NormKind,
    NormPlacement,
    OptimizerImpl,
    OptimizerKind,
    PositionKind,
    QkNorm,
)
from planner.model.limits import size_problems

__all__ = [
    "Activation",
    "AttentionImpl",
    "Family",
    "Implementation",
    "LayerType",
    "LossKind",
    "MOE_FAMILIES",
    "MlpKind",
    "ModelConfig",
    "NormKind",
    "NormPlacement",
    "OptimizerImpl",
    "OptimizerKind",
    "PositionKind",
    "QkNorm",
    "TrainConfig",
]


class ModelConfig(BaseModel):
    """A decoder-only transformer. Unset architecture fields take the family's defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="custom", description="label used in reports")
    family: Family
    n_layers: PositiveInt = Field(description="number of transformer blocks (L)")
    d_model: PositiveInt = Field(description="hidden size (D)")
    n_heads: PositiveInt = Field(description="attention heads (N); d_model must be divisible by it")
    n_kv_heads: PositiveInt | None = Field(default=None, description="key/value heads (K) for GQA; default n_heads")
    attention_head_dim: PositiveInt | None = Field(
        default=None, description="each head's size (H) where it is not d_model / n_heads (transformers' head_dim: "
        "Qwen3, Mixtral-style configs that set it); q and o then project D <-> N H")
    d_ff: PositiveInt = Field(description="MLP inner size (F)")
    vocab_size: PositiveInt = Field(description="vocabulary size (V)")
    max_seq_len: PositiveInt | None = Field(
        default=None,
        description="longest context the positions support: required for learned positions (the table's rows); "
                    "for rotary ones only a bound, defaulting to the training seq_len",
    )
    tie_embeddings: bool | None = Field(default=None, description="LM head shares the token embedding")
    qkv_bias: bool | None = None
    attn_out_bias: bool | None = None
    mlp_bias: bool | None = None
    norm_bias: bool | None = Field(default=None, description="LayerNorm has a bias (RMSNorm never has one)")
    norm: NormKind | None = None
    norm_placement: NormPlacement | None = Field(
        default=None, description="pre: each branch normed on its way in (x + attn(norm(x))); post: on its way out "
        "(x + norm(attn(x)), OLMo 2); sandwich: both (x + norm(attn(norm(x))), Gemma); default the family's")
    mlp: MlpKind | None = None
    positions: PositionKind | None = None
    norm_eps: float | None = Field(default=None, gt=0)
    qk_norm: QkNorm | None = Field(default=None, description="RMSNorm on q and k: none, head (Qwen3) or full (OLMoE)")
    moe: MoeConfig | None = Field(default=None, description="mixture-of-experts MLPs "
                                  "(planner.model.families.moe.config); None: every block dense")
    mla: MlaConfig | None = Field(
        default=None, description="multi-head latent attention (planner.model.families.deepseek.config; "
        "DeepSeek-V2/V3) in place of q/k/v projections: qkv_bias then sets q_a_proj's and kv_a_proj_with_mqa's "
        "biases (DeepSeek's attention_bias); None: plain multi-head attention")
    llama4: Llama4Config | None = Field(
        default=None, description="Llama 4's attention (planner.model.families.llama4.config): no-RoPE blocks with "
        "temperature tuning, the q/k L2 norm on the RoPE blocks, chunked local attention; None: none of these")
    rope_theta: float = Field(default=10000.0, gt=0)
    partial_rotary_factor: float | None = Field(
        default=None, gt=0, le=1, description="the share of each head's H dims RoPE rotates (transformers' "
        "partial_rotary_factor: the first int(H x factor) dims, the rest passed through and concatenated); None: all")
    query_pre_attn_scalar: float | None = Field(
        default=None, gt=0, description="attention scores scaled by query_pre_attn_scalar^-0.5 instead of H^-0.5 "
        "(Gemma); a value only: no cost changes")
    scale_embeddings: bool | None = Field(
        default=None, description="the token embedding times sqrt(d_model) (Gemma's scaled word embedding): one "
        "more (B, T, D) elementwise op; default the family's")
    rope_local_theta: float | None = Field(
        default=None, gt=0, description="RoPE base of the sliding-window blocks where it differs from rope_theta "
        "(Gemma 3's rope_local_base_freq): a second pair of cos/sin tables; None: one base for every block")
    fused_projections: bool | None = Field(
        default=None, description="q, k, v as one qkv_proj and gate, up as one gate_up_proj, each output split into "
        "views (Phi-3); default the family's")
    sliding_window: PositiveInt | None = Field(
        default=None, description="keys a query of a sliding layer sees, itself included (transformers' "
        "sliding_window: query i sees key j iff i - sliding_window < j <= i); None: no window. The reference model "
        "runs it as eager attention with a windowed mask (the full T x T square computed, then masked)")
    layer_types: tuple[LayerType, ...] | None = Field(
        default=None, description="each block's attention, full_attention or sliding_attention (transformers' "
        "layer_types); None: every block slides when sliding_window is set (Mistral)")
    attention_sinks: bool | None = Field(
        default=None, description="a learned logit per head (its (N,) parameter) joins every row of scores before "
        "the softmax and its probability is dropped after (gpt-oss); eager attention only")
    attn_logit_softcapping: float | None = Field(
        default=None, gt=0, description="attention scores soft-capped, c * tanh(s / c), before the mask (Gemma 2's "
        "attn_logit_softcapping): three (B, N, T, T) elementwise ops, tanh's output saved; eager attention only")
    final_logit_softcapping: float | None = Field(
        default=None, gt=0, description="logits soft-capped, c * tanh(z / c), before the loss (Gemma 2's "
        "final_logit_softcapping): three (B, T, V) elementwise ops, tanh's output saved; the plain loss only")
    attention: AttentionImpl = Field(default=AttentionImpl.FLASH, description="flash (fused SDPA) or eager")
    attention_kernel: AttentionKernel | None = Field(
        default=None,
        description="the fused kernel that runs flash attention (flash2, flash3, cudnn, flash-triton: "
                    "llm-foundry's attn_impl: triton); default: the one the "
                    "hardware profile says PyTorch's SDPA picks there. Prices time only; memory is the same",
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout probability (embeddings, attention, residual)")
    implementation: Implementation = Field(
        default=Implementation.REFERENCE,
        description="whose code runs the model: reference (roofplan's reference model), hf (transformers) or "
                    "torchtitan; each saves different tensors (planner.graph.implementations)")
    activation: Activation | None = Field(
        default=None,
        description="the MLP's activation as the implementation computes it (transformers' names); default: the "
                    "implementation's (hf GPT-2: gelu_new, GPT2Config's default; otherwise gelu_pytorch_tanh, or "
                    "silu for SwiGLU). The reference model runs every GELU as the fused tanh kernel")
    loss: LossKind | None = Field(
        default=None,
        description="plain, chunked (torchtitan's ChunkedLossWrapper) or fused-linear (Liger's fused linear "
                    "cross-entropy); default: the implementation's (torchtitan chunked, the others plain)")
    loss_chunks: PositiveInt | None = Field(
        default=None, description="sequence chunks of the chunked loss (default 8, torchtitan 0.3.0's num_chunks)")
    finetune: FinetuneConfig | None = Field(
        default=None, description="train adapters on the frozen model (planner.finetune.config: method lora, rank, "
                                  "alpha, dropout, target_modules); None: every parameter trains")

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        return with_family_defaults(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _shapes_consistent(self) -> ModelConfig:
        problems = shape_problems(self.model_dump())
        if self.norm_placement is NormPlacement.POST and self.norm is not NormKind.RMSNORM:
            problems.append("norm_placement: post-norm blocks are priced with RMSNorm only (OLMo 2); set norm: rmsnorm "
                            "or norm_placement: pre")
        problems.extend(self._phi3_problems())
        problems.extend(self._llama4_problems())
        problems.extend(softcap_problems(self.attn_logit_softcapping, self.final_logit_softcapping,
                                         self.attention.value, effective_loss(self).value,
                                         self.implementation.value))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _phi3_problems(self) -> list[str]:
        """Partial rotary and fused projections: what they fit (an even rotated width; a dense
        SwiGLU block with plain multi-head attention)."""
        problems = []
        if self.partial_rotary_factor is not None and self.positions is PositionKind.ROTARY and (
                self.rope_dim < 2 or self.rope_dim % 2):
            problems.append(f"partial_rotary_factor: {self.partial_rotary_factor} rotates int({self.head_dim} x "
                            f"{self.partial_rotary_factor}) = {self.rope_dim} dims of each head; RoPE needs an even "
                            "number of at least 2; change the factor")
        if self.fused_projections and (self.mla is not None or self.moe is not None or self.mlp is not MlpKind.SWIGLU):
            problems.append("fused_projections: fused qkv_proj/gate_up_proj are priced for dense SwiGLU blocks with "
                            "plain attention (Phi-3) only; set fused_projections: false")
        return problems

    def _llama4_problems(self) -> list[str]:
        """Llama 4's attention settings: blocks that exist, with the attention they modify."""
        if self.llama4 is None:
            return []
        problems = []
        beyond = [b for b in self.llama4.nope_layers if b >= self.n_layers]
        if beyond:
            problems.append(f"llama4.nope_layers: blocks {beyond} beyond n_layers {self.n_layers}; list blocks "
                            f"0..{self.n_layers - 1}")
        if self.mla is not None or self.positions is not PositionKind.ROTARY or self.qk_norm not in (None, QkNorm.NONE):
            problems.append("llama4: Llama 4's attention is plain multi-head attention with rotary positions and no "
                            "q/k RMSNorm; drop mla and qk_norm, set positions: rotary")
        if self.fused_projections or self.attention_sinks or self.sliding_window is not None:
            problems.append("llama4: fused projections, attention sinks and sliding windows are not Llama 4's; drop "
                            "them or the llama4 section")
        return problems

    @property
    def head_dim(self) -> int:
        """H: ``attention_head_dim``, else D / N."""
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The rotated dims of each query/key head: MLA's qk_rope_head_dim, else int(H x
        ``partial_rotary_factor``) (transformers 5.24.0, ``Phi3RotaryEmbedding``), else H."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        if self.partial_rotary_factor is not None:
            return int(self.head_dim * self.partial_rotary_factor)
        return self.head_dim

    @property
    def local_rope(self) -> bool:
        """Whether the sliding-window blocks rotate with a base of their own (``rope_local_theta``)."""
        return (self.rope_local_theta is not None and self.rope_local_theta != self.rope_theta
                and any(self.window(b) is not None for b in range(self.n_layers)))

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (``max_seq_len``; validated present for learned positions)."""
        if self.max_seq_len is None:
            raise ValueError(f"{self.name}: a learned position table needs max_seq_len")
        return self.max_seq_len

    def window(self, block: int) -> int | None:
        """Block ``block``'s sliding window (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[block] is LayerType.SLIDING:
            return self.sliding_window
        return None

    def window_refusal(self, seq_len: int) -> str | None:
        """One line when a sliding window binds at ``seq_len`` under flash attention, else None.

        A window of W keys masks nothing while T <= W (query i sees keys i - W < j <= i, all of
        0..i), so flash attention (SDPA with ``is_causal``, no window) is then exact. transformers
        (5.24.0, ``masking_utils._ignore_causal_mask_sdpa``) keeps ``is_causal`` only while T < W:
        at T = W it already builds the window mask, so implementation hf needs T < W. Past that the
        window is priced only as eager attention (the full square, masked), never ignored."""
        if self.llama4 is not None and self.llama4.chunk_refusal(seq_len) is not None:
            return self.llama4.chunk_refusal(seq_len)
        windows = [w for w in (self.window(b) for b in range(self.n_layers)) if w is not None]
        if self.attention is not AttentionImpl.FLASH or not windows:
            return None
        hf = self.implementation is Implementation.HF
        window = min(windows)
        if seq_len < window or (seq_len == window and not hf):
            return None
        if hf:
            return (f"sliding_window: transformers masks attention with the {window}-key window once the "
                    f"sequence reaches it (training.seq_len {seq_len}); that masked SDPA is not priced; plan "
                    f"--seq-len {window - 1} or less, or use implementation reference with --attention eager")
        return (f"sliding_window: {window} keys per query is below training.seq_len {seq_len}, and flash attention "
                "(SDPA, is_causal) takes no window; plan --attention eager (the full square masked with the window, "
                f"as transformers' eager path runs it) or --seq-len {window} or less")

    @property
    def kv_heads(self) -> int:
        """K (never None after validation)."""
        return self.n_kv_heads or self.n_heads


class TrainConfig(BaseModel):
    """One optimizer step's workload: sequences of ``seq_len`` tokens, ``global_batch_size`` of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: PositiveInt = Field(description="tokens per sequence (T)")
    global_batch_size: PositiveInt = Field(description="sequences per optimizer step, over all GPUs")
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH
    weight_decay: float = Field(default=0.1, ge=0.0)
    stack: Stack = Field(default=DEFAULT_STACK, description="the software stack the step runs under (hardware/stacks): "
                         "which kernels it calls and the residual fitted to its published runs")

    @model_validator(mode="after")
    def _sizes_bounded(self) -> TrainConfig:
        problems = size_problems({"seq_len": self.seq_len, "global_batch_size": self.global_batch_size}) or size_problems(
            {"seq_len x global_batch_size": self.tokens_per_step})
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size


def effective_activation(model: ModelConfig) -> Activation:
    """The activation the implementation computes: the model's, else the implementation's
    default (the reference runs every GELU as the fused tanh kernel, whatever the field says)."""
    if model.mlp is MlpKind.SWIGLU:
        return Activation.SILU
    if model.implementation is Implementation.REFERENCE:
        return Activation.GELU_PYTORCH_TANH
    return model.activation or IMPLEMENTATION_GPT2_ACTIVATION[model.implementation]


def effective_loss(model: ModelConfig) -> LossKind:
    """The loss the model trains with: the file's, else its implementation's default."""
    return LossKind(model.loss) if model.loss is not None else IMPLEMENTATION_LOSS[model.implementation]


def effective_loss_chunks(model: ModelConfig) -> int:
    """Sequence chunks of the chunked loss: the file's, else torchtitan's default."""
    return model.loss_chunks or TORCHTITAN_LOSS_CHUNKS
