"""The gpt-oss transformers config (model_type gpt_oss): what it adds to a Llama-like ``config.json``,
read into ``ModelConfig`` fields. ``planner.model.families.dense.reader`` reads the common sizes.

Mapped from transformers 5.24.0's ``configuration_gpt_oss.py`` (``GptOssConfig``) and
``modeling_gpt_oss.py``:

- attention (``GptOssAttention``): q, k, v and o biased by ``attention_bias`` (default true), a
  learned sink logit per head (``sinks``, (N,)), ``head_dim`` (class default 64); layer i slides over ``sliding_window`` keys (default 128) iff ``layer_types[i]`` is
  sliding_attention (default: even layers slide, odd ones are full). ``_supports_sdpa`` is False:
  transformers runs it eagerly (the full square, masked), so the planner plans eager attention.
- MLP (``GptOssMLP``): every block sparse; ``GptOssTopKRouter`` (a biased E x D linear, the top
  ``num_experts_per_tok`` logits, softmax over those k); ``num_local_experts`` (alias
  ``num_experts``) experts of ``intermediate_size``, their ``gate_up_proj`` (E, D, 2I) and
  ``down_proj`` (E, I, D) biased, the clamped SwiGLU between (``swiglu_alpha``, ``swiglu_limit``).
- RoPE: ``rope_parameters``/``rope_scaling`` of type yarn (the default) or default. YaRN changes
  the frequencies and scales cos/sin by a constant: the same tables, the same cost as plain RoPE,
  which is what the planner prices.
- ``quantization_config`` (the published MXFP4 experts) is ignored: it is how the checkpoint is
  stored for inference; a training plan holds the weights in its precision (bf16 or fp32).
- ``hidden_act`` is read by nothing in GptOssModel (the experts gate themselves) and is ignored.

Refused in one line naming the key: a null head_dim (GptOssConfig rejects it), a rope type other than yarn or default, layer types other
than sliding_attention/full_attention or not one per layer, a null window with sliding layers,
top-k above the experts, ``output_router_logits`` true (the load-balancing loss over this router
is not modelled yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError
from planner.model.families.dense.reader import GATED_KEYS, gated_fields, gated_shape
from planner.model.families.dense.windows import listed_layer_types
from planner.model.families.fields import FamilyReader, FamilySpec, Shape, hf_bool, hf_float, hf_int, refuse_rope_types
from planner.model.families.gpt_oss.config import FILE_DEFAULTS, SECTIONS
from planner.model.families.moe.config import ExpertActivation, RouterScoring
from planner.model.kinds import AttentionImpl, LayerType, QkNorm

# GptOssConfig's defaults (transformers 5.24.0) for the keys a config.json may omit; tests check
# them against the installed transformers.
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "attention_dropout": 0.0, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "output_router_logits": False, "attention_bias": True,
    "rope_theta": 150000.0,  # GptOssConfig.default_theta
}

_ROPE_TYPES = (None, "default", "yarn")


def gpt_oss_fields(data: Mapping[str, Any], *, n_layers: int, d_model: int, n_heads: int, d_ff: int,
                   context: str) -> dict[str, Any]:
    """The ModelConfig fields of a gpt_oss config.json beyond the Llama-like ones (``d_ff`` is its
    ``intermediate_size``, each expert's); a ConfigError naming the key for what cannot be planned."""
    d = GPT_OSS_DEFAULTS
    _refuse_rope(data, context)
    expert_key = next((key for key in ("num_local_experts", "num_experts") if data.get(key) is not None),
                      "num_local_experts")
    n_experts = hf_int(data, expert_key, context, default=d["num_local_experts"])
    top_k = hf_int(data, "num_experts_per_tok", context, default=d["num_experts_per_tok"])
    if top_k > n_experts:
        raise ConfigError(f"{context}: num_experts_per_tok: {top_k} exceeds {expert_key} = {n_experts}; a token is "
                          "routed to at most every expert")
    if hf_bool(data, "output_router_logits", context, d["output_router_logits"]):
        raise ConfigError(f"{context}: output_router_logits: the load-balancing loss over gpt-oss's top-k-then-softmax "
                          "router is not modelled yet; set it to false")
    moe = {
        "n_experts": n_experts, "top_k": top_k, "d_ff_expert": d_ff, "norm_topk_prob": False,
        "router_bias": True, "expert_bias": True, "expert_activation": ExpertActivation.CLAMPED_SWIGLU,
        "scoring": RouterScoring.TOPK_SOFTMAX,
        "swiglu_alpha": _positive(data, "swiglu_alpha", context), "swiglu_limit": _positive(data, "swiglu_limit", context),
    }
    bias = hf_bool(data, "attention_bias", context, d["attention_bias"])
    fields: dict[str, Any] = {
        "moe": moe, "qkv_bias": bias, "attn_out_bias": bias, "mlp_bias": False, "qk_norm": QkNorm.NONE,
        "attention": AttentionImpl.EAGER, "attention_sinks": True,
    }
    # head_dim: absent takes the class default (64); null is refused by GptOssConfig (a strict int field)
    if "head_dim" in data and data["head_dim"] is None:
        raise ConfigError(f"{context}: head_dim: null is rejected by transformers' GptOssConfig (an int field); give "
                          "the head size or omit it (default 64)")
    head_dim = hf_int(data, "head_dim", context, default=d["head_dim"])
    if head_dim * n_heads != d_model:
        fields["attention_head_dim"] = head_dim
    layer_types = _layer_types(data, n_layers, context)
    window = data.get("sliding_window", d["sliding_window"])
    if window is not None:
        window = hf_int(data, "sliding_window", context, default=d["sliding_window"])
    if window is None and LayerType.SLIDING in layer_types:
        raise ConfigError(f"{context}: sliding_window: null, but layer_types has sliding_attention layers; give the "
                          "window (GptOssConfig's default is 128) or list full_attention only")
    if window is not None and LayerType.SLIDING in layer_types:
        fields.update(sliding_window=window, layer_types=layer_types)
    return fields


def _positive(data: Mapping[str, Any], key: str, context: str) -> float:
    value = hf_float(data, key, context, GPT_OSS_DEFAULTS[key])
    if value <= 0:
        raise ConfigError(f"{context}: {key}: expected a positive number, got {value!r}")
    return value


def _layer_types(data: Mapping[str, Any], n_layers: int, context: str) -> tuple[LayerType, ...]:
    """``layer_types``, or GptOssConfig's default: layer i slides iff i is even."""
    raw = data.get("layer_types")
    if raw is None:
        return tuple(LayerType.SLIDING if (i + 1) % 2 else LayerType.FULL for i in range(n_layers))
    return listed_layer_types(raw, n_layers, context)


def _refuse_rope(data: Mapping[str, Any], context: str) -> None:
    refuse_rope_types(data, context, _ROPE_TYPES, "for gpt_oss (yarn and default cost plain RoPE)",
                      "use rope_type yarn or default")


def _fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """gpt_oss's ModelConfig fields: the Llama-like ones (its ``hidden_act`` is read by nothing), then its own."""
    fields = gated_fields(data, model_type, defaults, context, read_act=False)
    fields.update(gpt_oss_fields(data, n_layers=shape.n_layers, d_model=shape.d_model, n_heads=shape.n_heads,
                                 d_ff=shape.d_ff, context=context))
    return fields


READER = FamilyReader(defaults={"gpt_oss": GPT_OSS_DEFAULTS}, shape=gated_shape, fields=_fields, keys=GATED_KEYS)

# the family's registration (planner.model.families.registry)
FAMILY = FamilySpec(readers=(READER,), defaults=FILE_DEFAULTS, sections=SECTIONS)
