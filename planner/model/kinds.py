"""The kinds a model file names (family, norm, MLP, positions, attention implementation, loss,
optimizer). Each family's defaults for the fields a file leaves out live in its package
(``planner.model.families.<family>.config``, gathered by ``planner.model.families.registry``)."""

from __future__ import annotations

from enum import StrEnum


class Family(StrEnum):
    GPT2 = "gpt2"
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"  # Qwen2's layout with per-head q/k RMSNorm, an explicit head dim, no q/k/v biases
    OLMO2 = "olmo2"  # Llama's layout, norms after attention and MLP, q/k RMSNorm over all heads
    MIXTRAL = "mixtral"  # Mistral with MoE MLPs
    QWEN2_MOE = "qwen2_moe"  # Qwen2 with MoE MLPs, a gated shared expert
    QWEN3_MOE = "qwen3_moe"  # per-head q/k RMSNorm, no biases, MoE MLPs
    OLMOE = "olmoe"  # q/k RMSNorm over all heads, MoE MLPs
    DEEPSEEK_V3 = "deepseek_v3"  # multi-head latent attention, sigmoid group-limited router, dense first blocks
    GPT_OSS = "gpt_oss"  # attention sinks, sliding-window layers, biased clamped-SwiGLU experts
    LLAMA4_TEXT = "llama4_text"  # MoE interleaved with dense blocks, no-RoPE layers, q/k L2 norm, chunked attention
    PHI3 = "phi3"  # Llama's layout with fused qkv_proj and gate_up_proj, partial rotary
    GEMMA2 = "gemma2"  # norms before and after each branch, GeGLU, scaled embedding, sliding/global layers
    GEMMA3_TEXT = "gemma3_text"  # Gemma 2's layout, per-head q/k norms, two RoPE bases (a gemma3 file's text model)


class NormKind(StrEnum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    GEMMA_RMSNORM = "gemma-rmsnorm"  # in fp32 times (1 + w), cast back (transformers' Gemma2/Gemma3 RMSNorm)


class MlpKind(StrEnum):
    GELU = "gelu"  # up -> GELU(tanh) -> down (GPT-2)
    SWIGLU = "swiglu"  # silu(gate) * up -> down (Llama, Mistral, Qwen2)
    GEGLU = "geglu"  # gelu_tanh(gate) * up -> down (Gemma)


class PositionKind(StrEnum):
    LEARNED = "learned"  # a (max_seq_len, d_model) table added to the token embedding
    ROTARY = "rotary"  # RoPE applied to q and k inside attention


class NormPlacement(StrEnum):
    """Where a block's two norms sit."""

    PRE = "pre"  # x + attn(norm(x)), then x + mlp(norm(x)) (GPT-2, Llama)
    POST = "post"  # x + norm(attn(x)), then x + norm(mlp(x)) (OLMo 2: the norm on each branch's output)
    SANDWICH = "sandwich"  # x + norm(attn(norm(x))), then x + norm(mlp(norm(x))) (Gemma 2/3: both)


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
    """Whose code runs the model: each allocates differently (``planner.graph.implementations`` says how,
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


# The families whose transformers code implementation hf prices (planner.graph.implementations)
HF_FAMILIES = frozenset({Family.GPT2, Family.LLAMA, Family.MISTRAL, Family.QWEN2})


# What each implementation's code runs where a model file does not say (read from its source, at
# the versions planner.graph.implementations names): its loss, and its GPT-2 MLP's activation.
IMPLEMENTATION_LOSS: dict[Implementation, LossKind] = {
    Implementation.REFERENCE: LossKind.PLAIN, Implementation.HF: LossKind.PLAIN,
    Implementation.TORCHTITAN: LossKind.CHUNKED,  # torchtitan 0.3.0 ChunkedLossWrapper
}
IMPLEMENTATION_GPT2_ACTIVATION: dict[Implementation, Activation] = {
    Implementation.REFERENCE: Activation.GELU_PYTORCH_TANH, Implementation.HF: Activation.GELU_NEW,  # GPT2Config
    Implementation.TORCHTITAN: Activation.GELU_PYTORCH_TANH,
}
TORCHTITAN_LOSS_CHUNKS = 8  # torchtitan 0.3.0 ChunkedLossWrapper.Config.num_chunks
