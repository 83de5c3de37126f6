"""What is trained (ModelConfig) and how (TrainConfig): frozen, validated, documented fields.

Field names follow the transformers/torchtitan vocabulary; every size is validated here so a
bad file fails with the field's name rather than deep inside a formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from hardware.kernels import AttentionKernel
from planner.mla_config import MlaConfig
from planner.moe_config import MoeConfig


class Family(StrEnum):
    GPT2 = "gpt2"
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    MIXTRAL = "mixtral"  # Mistral with MoE MLPs
    QWEN2_MOE = "qwen2_moe"  # Qwen2 with MoE MLPs, a gated shared expert
    QWEN3_MOE = "qwen3_moe"  # per-head q/k RMSNorm, no biases, MoE MLPs
    OLMOE = "olmoe"  # q/k RMSNorm over all heads, MoE MLPs
    DEEPSEEK_V3 = "deepseek_v3"  # multi-head latent attention, sigmoid group-limited router, dense first blocks
    GPT_OSS = "gpt_oss"  # attention sinks, sliding-window layers, biased clamped-SwiGLU experts


class NormKind(StrEnum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class MlpKind(StrEnum):
    GELU = "gelu"  # up -> GELU(tanh) -> down (GPT-2)
    SWIGLU = "swiglu"  # silu(gate) * up -> down (Llama, Mistral, Qwen2)


class PositionKind(StrEnum):
    LEARNED = "learned"  # a (max_seq_len, d_model) table added to the token embedding
    ROTARY = "rotary"  # RoPE applied to q and k inside attention


class QkNorm(StrEnum):
    """RMSNorm on the queries and keys before rotary positions."""

    NONE = "none"
    HEAD = "head"  # over each head's H values, one (H,) weight (Qwen3)
    FULL = "full"  # over all heads' N H (K H for keys) values (OLMoE)


class LayerType(StrEnum):
    """A block's attention (transformers' ``layer_types`` values)."""

    FULL = "full_attention"  # causal over the whole sequence
    SLIDING = "sliding_attention"  # causal over the last ``sliding_window`` keys


class AttentionImpl(StrEnum):
    FLASH = "flash"  # fused SDPA: saves q, k, v, output and a log-sum-exp per row
    EAGER = "eager"  # matmul, softmax, dropout, matmul: saves the T x T probabilities


class Implementation(StrEnum):
    """Whose code runs the model: each allocates differently (``planner.implementations`` says how,
    from that library's source at a named version)."""

    REFERENCE = "reference"  # validate/reference_model.py
    HF = "hf"  # transformers' modeling_gpt2/llama/mistral/qwen2.py (transformers 5.24.0)
    TORCHTITAN = "torchtitan"  # torchtitan 0.3.0's Llama3Model (family llama only)


class Activation(StrEnum):
    """The MLP's activation as an implementation computes it (transformers' ACT2FN names)."""

    GELU_PYTORCH_TANH = "gelu_pytorch_tanh"  # F.gelu(approximate="tanh"): one fused kernel, saves its input
    GELU = "gelu"  # F.gelu (exact erf): one fused kernel, saves its input
    GELU_NEW = "gelu_new"  # transformers' NewGELUActivation: the tanh formula written out in Python
    GELU_FAST = "gelu_fast"  # transformers' FastGELUActivation: written out in Python
    SILU = "silu"  # the gate of a SwiGLU MLP


class LossKind(StrEnum):
    """How the LM head and the cross-entropy run (``planner.ops.losses`` prices each)."""

    PLAIN = "plain"  # the whole (B, T, V) logits, upcast to fp32, one F.cross_entropy
    CHUNKED = "chunked"  # torchtitan 0.3.0's ChunkedLossWrapper: lm_head + loss + backward per sequence chunk
    FUSED_LINEAR = "fused-linear"  # Liger-Kernel's fused linear cross-entropy: token chunks, no logits kept


class OptimizerKind(StrEnum):
    ADAMW = "adamw"
    SGD_MOMENTUM = "sgd-momentum"
    SGD = "sgd"


class OptimizerImpl(StrEnum):
    FOREACH = "foreach"  # torch's default on CUDA: multi-tensor kernels with param-sized temporaries
    FUSED = "fused"  # one fused kernel, updates in place


_FAMILY_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.GPT2: dict(
        norm=NormKind.LAYERNORM, mlp=MlpKind.GELU, positions=PositionKind.LEARNED,
        tie_embeddings=True, qkv_bias=True, attn_out_bias=True, mlp_bias=True, norm_bias=True, norm_eps=1e-5,
    ),
    Family.LLAMA: dict(
        norm=NormKind.RMSNORM, mlp=MlpKind.SWIGLU, positions=PositionKind.ROTARY,
        tie_embeddings=False, qkv_bias=False, attn_out_bias=False, mlp_bias=False, norm_bias=False, norm_eps=1e-5,
    ),
    Family.MISTRAL: dict(
        norm=NormKind.RMSNORM, mlp=MlpKind.SWIGLU, positions=PositionKind.ROTARY,
        tie_embeddings=False, qkv_bias=False, attn_out_bias=False, mlp_bias=False, norm_bias=False, norm_eps=1e-5,
    ),
    Family.QWEN2: dict(
        norm=NormKind.RMSNORM, mlp=MlpKind.SWIGLU, positions=PositionKind.ROTARY,
        tie_embeddings=False, qkv_bias=True, attn_out_bias=False, mlp_bias=False, norm_bias=False, norm_eps=1e-6,
    ),
}
_FAMILY_DEFAULTS[Family.MIXTRAL] = dict(_FAMILY_DEFAULTS[Family.MISTRAL])
_FAMILY_DEFAULTS[Family.QWEN2_MOE] = dict(_FAMILY_DEFAULTS[Family.QWEN2])
_FAMILY_DEFAULTS[Family.QWEN3_MOE] = dict(_FAMILY_DEFAULTS[Family.QWEN2], qkv_bias=False, qk_norm=QkNorm.HEAD)
_FAMILY_DEFAULTS[Family.OLMOE] = dict(_FAMILY_DEFAULTS[Family.LLAMA], qk_norm=QkNorm.FULL)
_FAMILY_DEFAULTS[Family.DEEPSEEK_V3] = dict(_FAMILY_DEFAULTS[Family.LLAMA], norm_eps=1e-6)
# GptOssAttention: q, k, v and o biased (attention_bias), a sink logit per head
_FAMILY_DEFAULTS[Family.GPT_OSS] = dict(_FAMILY_DEFAULTS[Family.LLAMA], qkv_bias=True, attn_out_bias=True,
                                        attention_sinks=True)
for _defaults in _FAMILY_DEFAULTS.values():
    _defaults.setdefault("attention_sinks", False)
MOE_FAMILIES = frozenset({Family.MIXTRAL, Family.QWEN2_MOE, Family.QWEN3_MOE, Family.OLMOE, Family.DEEPSEEK_V3,
                          Family.GPT_OSS})


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
    mlp: MlpKind | None = None
    positions: PositionKind | None = None
    norm_eps: float | None = Field(default=None, gt=0)
    qk_norm: QkNorm | None = Field(default=None, description="RMSNorm on q and k: none, head (Qwen3) or full (OLMoE)")
    moe: MoeConfig | None = Field(default=None, description="mixture-of-experts MLPs (planner.moe_config); "
                                  "None: every block dense")
    mla: MlaConfig | None = Field(
        default=None, description="multi-head latent attention (planner.mla_config; DeepSeek-V2/V3) in place of q/k/v "
        "projections: qkv_bias then sets q_a_proj's and kv_a_proj_with_mqa's biases (DeepSeek's attention_bias); "
        "None: plain multi-head attention")
    rope_theta: float = Field(default=10000.0, gt=0)
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
                    "torchtitan; each saves different tensors (planner.implementations)")
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

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        return with_family_defaults(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _shapes_consistent(self) -> ModelConfig:
        problems = shape_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def head_dim(self) -> int:
        """H: ``attention_head_dim``, else D / N."""
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The rotated dims of each query/key head: MLA's qk_rope_head_dim, else H."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

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

    @property
    def kv_heads(self) -> int:
        """K (never None after validation)."""
        return self.n_kv_heads or self.n_heads


def with_family_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
    """A model section with its family's defaults filled in (an unknown family: unchanged, the
    field validator names it)."""
    try:
        family = Family(str(data.get("family")))
    except ValueError:
        return dict(data)
    merged = dict(data)
    for key, value in _FAMILY_DEFAULTS[family].items():
        if merged.get(key) is None:
            merged[key] = value
    if merged.get("n_kv_heads") is None:
        merged["n_kv_heads"] = merged.get("n_heads")
    if merged.get("qk_norm") is None:
        merged["qk_norm"] = QkNorm.NONE
    return merged


def shape_problems(values: Mapping[str, Any]) -> list[str]:
    """Every problem between fields of a model section (family defaults applied) whose values are
    themselves valid: ``ModelConfig`` raises them together, and a file that also has bad fields
    gets them in the same message (pydantic runs no model check while a field fails)."""
    def size(key: str) -> int | None:
        value = values.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    d, n = size("d_model"), size("n_heads")
    k = size("n_kv_heads") if values.get("n_kv_heads") is not None else n
    positions = values.get("positions")
    problems = []
    explicit = size("attention_head_dim")
    mla = values.get("mla")
    if mla is not None:
        problems.extend(_mla_problems(values, n, k))
        d = None  # MLA's head dims are its own: d_model need not split into heads
    if explicit:
        d = explicit * n if n else None  # the rotary check below reads H = d / n
    if d and n and d % n:
        problems.append(f"d_model ({d}) must be divisible by n_heads ({n}), or set attention_head_dim; change one "
                        "of them")
    if n and k and n % k:
        problems.append(f"n_heads ({n}) must be divisible by n_kv_heads ({k}) for grouped-query attention")
    if positions in (PositionKind.LEARNED, PositionKind.LEARNED.value) and values.get("max_seq_len") is None:
        problems.append("max_seq_len: required with learned positions (the position table has max_seq_len rows); "
                        "add it to the model section")
    if positions in (PositionKind.ROTARY, PositionKind.ROTARY.value) and d and n and not d % n and (d // n) % 2:
        problems.append(f"rotary positions need an even head dim, got d_model/n_heads = {d // n}")
    family = values.get("family")
    moe = values.get("moe")
    problems.extend(attention_problems(values))
    if family in (Family.DEEPSEEK_V3, Family.DEEPSEEK_V3.value) and mla is None:
        problems.append("mla: family deepseek_v3 has multi-head latent attention; add an mla section (kv_lora_rank, "
                        "qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)")
    if family in MOE_FAMILIES and moe is None:
        problems.append(f"moe: family {family} has mixture-of-experts MLPs; add a moe section (n_experts, top_k, "
                        "d_ff_expert)")
    problems.extend(implementation_problems(values))
    return problems


def _mla_problems(values: Mapping[str, Any], n: int | None, k: int | None) -> list[str]:
    """What multi-head latent attention cannot be combined with."""
    problems = []
    if values.get("positions") not in (PositionKind.ROTARY, PositionKind.ROTARY.value):
        problems.append("mla: multi-head latent attention rotates qk_rope_head_dim dims; use positions: rotary")
    if n and k and n != k:
        problems.append(f"n_kv_heads: multi-head latent attention expands keys and values to every head; set n_kv_heads "
                        f"to n_heads ({n}) or drop it")
    if values.get("attention_head_dim") is not None:
        problems.append("attention_head_dim: multi-head latent attention sets its head dims in mla; drop attention_head_dim")
    if values.get("qk_norm") not in (None, QkNorm.NONE, QkNorm.NONE.value):
        problems.append("qk_norm: multi-head latent attention norms its latents, not q and k; set qk_norm: none")
    if values.get("attention") in (AttentionImpl.EAGER, AttentionImpl.EAGER.value):
        problems.append("attention: eager attention with mla is not modelled yet (query/key and value head dims differ); "
                        "use attention: flash")
    return problems


def attention_problems(values: Mapping[str, Any]) -> list[str]:
    """Sliding windows and sinks: layer types that fit the blocks, and the attention that runs them."""
    problems = []
    raw_types = values.get("layer_types")
    types = [str(getattr(t, "value", t)) for t in raw_types] if isinstance(raw_types, list | tuple) else None
    n_layers = values.get("n_layers")
    if types is not None and isinstance(n_layers, int) and len(types) != n_layers:
        problems.append(f"layer_types: {len(types)} entries for n_layers {n_layers}; list one per block")
    sliding = values.get("sliding_window") is not None and (types is None or LayerType.SLIDING.value in types)
    if types is not None and LayerType.SLIDING.value in types and values.get("sliding_window") is None:
        problems.append("sliding_window: layer_types lists sliding_attention blocks but no window is set; set "
                        "sliding_window (or list full_attention only)")
    flash = str(getattr(values.get("attention"), "value", values.get("attention"))) == AttentionImpl.FLASH.value
    if sliding and flash:
        problems.append("sliding_window: the reference model's flash attention (PyTorch's SDPA) takes no window; set "
                        "attention: eager (transformers' eager path: the full square, masked) or drop sliding_window")
    if values.get("attention_sinks") and flash:
        problems.append("attention_sinks: PyTorch's SDPA has no sink logit; set attention: eager (transformers runs "
                        "gpt-oss eagerly: its _supports_sdpa is False)")
    return problems


_GELUS = frozenset({Activation.GELU_PYTORCH_TANH, Activation.GELU, Activation.GELU_NEW, Activation.GELU_FAST})


def implementation_problems(values: Mapping[str, Any]) -> list[str]:
    """What an implementation cannot run, and activations or losses that do not fit the model."""
    def member(enum: type[StrEnum], key: str) -> Any:
        value = values.get(key)
        try:
            return enum(str(value)) if value is not None else None
        except ValueError:
            return None  # the field's own validator names it

    impl, act, loss = member(Implementation, "implementation"), member(Activation, "activation"), member(LossKind, "loss")
    mlp = member(MlpKind, "mlp")
    problems = []
    if impl not in (None, Implementation.REFERENCE) and values.get("moe") is not None:
        problems.append(f"implementation: {impl.value}'s mixture-of-experts blocks (grouped_mm experts, sort-based "
                        "dispatch) are not priced yet; use implementation reference")
    if impl not in (None, Implementation.REFERENCE) and values.get("mla") is not None:
        problems.append(f"implementation: {impl.value}'s multi-head latent attention is not priced yet; use "
                        "implementation reference")
    if impl not in (None, Implementation.REFERENCE) and (values.get("sliding_window") or values.get("attention_sinks")):
        problems.append(f"implementation: {impl.value}'s sliding-window and sink attention are not priced yet; use "
                        "implementation reference")
    if impl is Implementation.TORCHTITAN and values.get("family") not in (Family.LLAMA, Family.LLAMA.value):
        problems.append(f"implementation: torchtitan is priced for family llama only (torchtitan 0.3.0's "
                        f"Llama3Model), not {values.get('family')}; use implementation hf or reference")
    if impl is Implementation.TORCHTITAN and (values.get("qkv_bias") or values.get("attn_out_bias")
                                              or values.get("mlp_bias")):
        problems.append("implementation: torchtitan's Llama3Model has no biases; set qkv_bias, attn_out_bias and "
                        "mlp_bias to false or use implementation hf")
    if act is not None and mlp is MlpKind.SWIGLU and act is not Activation.SILU:
        problems.append(f"activation: {act.value} does not gate a SwiGLU MLP; use silu (or mlp: gelu)")
    if act is not None and mlp is MlpKind.GELU and act not in _GELUS:
        problems.append(f"activation: {act.value} is not a GELU; use one of {', '.join(sorted(a.value for a in _GELUS))}")
    if values.get("loss_chunks") is not None and loss is not LossKind.CHUNKED and not (
            loss is None and impl is Implementation.TORCHTITAN):
        problems.append("loss_chunks: only the chunked loss has sequence chunks; set loss: chunked or drop loss_chunks")
    return problems


class TrainConfig(BaseModel):
    """One optimizer step's workload: sequences of ``seq_len`` tokens, ``global_batch_size`` of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: PositiveInt = Field(description="tokens per sequence (T)")
    global_batch_size: PositiveInt = Field(description="sequences per optimizer step, over all GPUs")
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH
    weight_decay: float = Field(default=0.1, ge=0.0)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size
