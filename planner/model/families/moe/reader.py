"""The mixture-of-experts transformers configs (model_type mixtral, qwen2_moe, qwen3_moe, olmoe;
deepseek_v3 in ``planner.model.families.deepseek``, gpt_oss in ``planner.model.families.gpt_oss``):
what they add to a Llama-like ``config.json``, read into ``ModelConfig`` fields (``moe``,
``qk_norm``, ``attention_head_dim``, the attention biases). ``planner.model.families.dense.reader``
reads the rest (``gated_shape``, ``gated_fields``).

Mapped from transformers 5.24.0's ``configuration_<type>.py`` and ``modeling_<type>.py``:

- mixtral: every block's MLP is ``MixtralSparseMoeBlock``: a router (E x D, no bias), E SwiGLU
  experts of ``intermediate_size``, top-k weights always renormalized; attention is Mistral's (no
  biases, ``head_dim`` honoured).
- qwen2_moe: block i is sparse iff i is not in ``mlp_only_layers`` and (i + 1) %
  ``decoder_sparse_step`` == 0, else a dense MLP of ``intermediate_size``; a sparse block has E
  experts of ``moe_intermediate_size``, a shared expert of ``shared_expert_intermediate_size`` and
  its sigmoid gate (D -> 1, no bias); q/k/v biases follow ``qkv_bias`` (o_proj has none).
- qwen3_moe: Qwen2-MoE's layout without shared experts; ``attention_bias`` sets q, k, v and o;
  RMSNorm over each head's ``head_dim`` values of q and k (``q_norm``/``k_norm``, (H,) weights).
- olmoe: every block sparse, E experts of ``intermediate_size``; ``attention_bias`` sets q, k, v
  and o; RMSNorm over all of q (D) and all of k (K D / N) before RoPE.

Sliding windows (mixtral and olmoe ``sliding_window``, qwen2_moe ``use_sliding_window`` with its
``layer_types``, qwen3_moe ``use_sliding_window``) are read as the dense types' are, by
``planner.model.families.dense.windows`` (its docstring gives each type's rule): ``sliding_window``
and ``layer_types``, priced as the reference model runs them (eager attention, the full square
masked; flash refused once the window binds, ``ModelConfig.window_refusal``).

The load-balancing loss is added to the loss (``router_aux_loss_coef`` x aux) only when the
model's forward returns router logits, i.e. when the config's ``output_router_logits`` is true;
otherwise no aux loss is computed, so ``aux_loss_coef`` is then 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError
from planner.model.families.dense.reader import GATED_KEYS, gated_fields, gated_shape
from planner.model.families.dense.windows import window_fields
from planner.model.families.fields import FamilyReader, FamilySpec, Shape, hf_bool, hf_float, hf_int, refuse_rope_types
from planner.model.families.moe.config import FILE_DEFAULTS, SECTIONS
from planner.model.kinds import QkNorm

# transformers' defaults (MixtralConfig / Qwen2MoeConfig / Qwen3MoeConfig / OlmoeConfig) for the keys
# a config.json may omit; tests check these against the installed transformers.
_COMMON = {"tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0, "output_router_logits": False}
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {
        **_COMMON, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
    },
    "qwen2_moe": {
        **_COMMON, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001, "qkv_bias": True, "use_sliding_window": False, "max_window_layers": 28,
    },
    "qwen3_moe": {
        **_COMMON, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "decoder_sparse_step": 1, "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": 4096,
    },
    "olmoe": {
        **_COMMON, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "num_key_value_heads": None, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
        "router_aux_loss_coef": 0.01, "attention_bias": False,
    },
}

# The key holding E, then the alias transformers' attribute_map also reads (Qwen2MoeConfig has none:
# it ignores num_local_experts).
_EXPERT_KEYS = {
    "mixtral": ("num_local_experts", "num_experts"),
    "qwen2_moe": ("num_experts",),
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "olmoe": ("num_experts", "num_local_experts"),
}
_CLASSES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe"}


def moe_fields(
    data: Mapping[str, Any], model_type: str, *, n_layers: int, d_model: int, n_heads: int, d_ff: int, context: str
) -> dict[str, Any]:
    """The ModelConfig fields a MoE config.json sets beyond the Llama-like ones (``d_ff`` is its
    ``intermediate_size``); a ConfigError naming the key for what the planner cannot express."""
    defaults = MOE_DEFAULTS[model_type]
    _refuse_unmodelled(data, model_type, context)
    if model_type in ("qwen2_moe", "qwen3_moe") and "num_key_value_heads" in data and data["num_key_value_heads"] is None:
        raise ConfigError(f"{context}: num_key_value_heads: null is rejected by transformers' {_CLASSES[model_type]}"
                          "Config (no MHA fallback); give the number of KV heads")
    keys = _EXPERT_KEYS[model_type]
    expert_key = next((key for key in keys if data.get(key) is not None), keys[0])
    n_experts = hf_int(data, expert_key, context, default=defaults[keys[0]])
    top_k = hf_int(data, "num_experts_per_tok", context, default=defaults["num_experts_per_tok"])
    if top_k > n_experts:
        raise ConfigError(f"{context}: num_experts_per_tok: {top_k} exceeds {expert_key} = {n_experts}; a token is "
                          "routed to at most every expert")
    moe: dict[str, Any] = {"n_experts": n_experts, "top_k": top_k}
    if model_type in ("mixtral", "olmoe"):
        moe["d_ff_expert"] = d_ff  # their experts are intermediate_size wide; no block is dense
    else:
        moe["d_ff_expert"] = hf_int(data, "moe_intermediate_size", context, default=defaults["moe_intermediate_size"])
        moe["first_dense_layers"], moe["every"] = _sparse_layout(data, n_layers, context)
    if model_type == "qwen2_moe":  # Qwen2MoeSparseMoeBlock: a shared expert and its sigmoid gate, always
        key = "shared_expert_intermediate_size"
        moe.update(shared_d_ff=hf_int(data, key, context, default=defaults[key]), shared_gate=True)
    # MixtralTopKRouter always renormalizes the top-k weights; the others follow norm_topk_prob
    moe["norm_topk_prob"] = model_type == "mixtral" or hf_bool(data, "norm_topk_prob", context, defaults["norm_topk_prob"])
    # the aux loss is computed and added only when output_router_logits is true (module docstring)
    if hf_bool(data, "output_router_logits", context, defaults["output_router_logits"]):
        moe["aux_loss_coef"] = hf_float(data, "router_aux_loss_coef", context, defaults["router_aux_loss_coef"])
    fields: dict[str, Any] = {"moe": moe, "mlp_bias": False, "qk_norm": QkNorm.NONE}
    if model_type == "mixtral":
        fields.update(qkv_bias=False, attn_out_bias=False)
    elif model_type == "qwen2_moe":
        fields.update(qkv_bias=hf_bool(data, "qkv_bias", context, defaults["qkv_bias"]), attn_out_bias=False)
    else:
        bias = hf_bool(data, "attention_bias", context, defaults["attention_bias"])
        fields.update(qkv_bias=bias, attn_out_bias=bias)
        fields["qk_norm"] = QkNorm.HEAD if model_type == "qwen3_moe" else QkNorm.FULL
    head_dim = hf_int(data, "head_dim", context, default=d_model // n_heads) if data.get("head_dim") is not None else None
    if head_dim is not None and head_dim * n_heads != d_model:
        if model_type == "olmoe":
            raise ConfigError(f"{context}: head_dim: {head_dim} differs from hidden_size / num_attention_heads = "
                              f"{d_model} / {n_heads}; OlmoeAttention's q/k norms span hidden_size and cannot run it; "
                              "drop head_dim")
        fields["attention_head_dim"] = head_dim
    return fields


def _fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """A MoE type's ModelConfig fields: the Llama-like ones, its sliding windows, then its own."""
    fields = gated_fields(data, model_type, defaults, context)
    fields.update(window_fields(data, model_type, shape.n_layers, context))  # as the dense types' (dense.windows)
    fields.update(moe_fields(data, model_type, n_layers=shape.n_layers, d_model=shape.d_model, n_heads=shape.n_heads,
                             d_ff=shape.d_ff, context=context))
    return fields


def _sparse_layout(data: Mapping[str, Any], n_layers: int, context: str) -> tuple[int, int]:
    """(first_dense_layers, every) giving exactly the sparse blocks of transformers' rule: block i is
    sparse iff i is not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0."""
    every = hf_int(data, "decoder_sparse_step", context, default=1)
    raw = data.get("mlp_only_layers")
    if raw is None:
        raw = []
    if not isinstance(raw, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in raw):
        raise ConfigError(f"{context}: mlp_only_layers: expected a list of block indices, got {raw!r}")
    sparse = {i for i in range(n_layers) if i not in raw and (i + 1) % every == 0}
    for first in range(n_layers + 1):
        if sparse == {i for i in range(first, n_layers) if (i + 1) % every == 0}:
            return first, every
    dense = sorted({i for i in raw if 0 <= i < n_layers})
    raise ConfigError(f"{context}: mlp_only_layers: dense blocks {dense} are not the first blocks; the planner keeps "
                      "dense MLPs only in a leading run of blocks (besides decoder_sparse_step); list only blocks "
                      "0, 1, ... there")


def _refuse_unmodelled(data: Mapping[str, Any], model_type: str, context: str) -> None:
    """One line naming the key, for what transformers would run but the planner cannot price."""
    refuse_rope_types(data, context, (None, "default"), "(the planner prices plain RoPE)",
                      "remove {key} or set its rope_type to default")
    if model_type == "mixtral" and hf_float(data, "router_jitter_noise", context, 0.0):
        raise ConfigError(f"{context}: router_jitter_noise: the router's input jitter (a noise tensor per block in "
                          "training) is not modelled; set it to 0")
    if model_type == "olmoe" and data.get("clip_qkv") is not None:
        raise ConfigError(f"{context}: clip_qkv: clamping q, k and v is not modelled; set it to null")


READER = FamilyReader(defaults=MOE_DEFAULTS, shape=gated_shape, fields=_fields, keys=GATED_KEYS)

# the family's registration (planner.model.families.registry)
FAMILY = FamilySpec(readers=(READER,), defaults=FILE_DEFAULTS, sections=SECTIONS)
