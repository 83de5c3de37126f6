"""The Gemma 2 and Gemma 3 transformers configs (model_type gemma2, gemma3_text; a multimodal
gemma3 file's ``text_config``), read into ``ModelConfig`` fields.

Mapped from transformers 5.24.0's ``models/gemma2/configuration_gemma2.py`` (``Gemma2Config``),
``models/gemma3/configuration_gemma3.py`` (``Gemma3TextConfig``, ``Gemma3Config``) and their
``modeling_*.py``:

- blocks (``Gemma2DecoderLayer``, ``Gemma3DecoderLayer``): ``input_layernorm`` before attention
  and ``post_attention_layernorm`` on its output before the residual add, the same around the MLP
  (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``): norm_placement sandwich. Every
  norm is ``Gemma*RMSNorm`` (fp32, times ``1 + w``, cast back; ``planner.ops.gemma``).
- MLP: ``act(gate_proj(x)) * up_proj(x)`` with ``hidden_activation`` gelu_pytorch_tanh: GeGLU.
- attention: q, k, v, o biased by ``attention_bias`` (default false), ``head_dim`` (default 256),
  scores scaled by ``query_pre_attn_scalar``^-0.5 (default 256; a value only), Gemma 3 norms q
  and k over each head (``q_norm``/``k_norm``, Gemma RMSNorm). Layer i slides over
  ``sliding_window`` keys (default 4096) iff ``layer_types[i]`` is sliding_attention; by default
  every 2nd layer is full (Gemma 2) or every ``sliding_window_pattern``-th (Gemma 3, default 6).
- RoPE: Gemma 2 one base (``rope_theta``, default 10000); Gemma 3 the full layers' (default 1e6,
  ``rope_parameters.full_attention``) and the sliding layers' (``rope_local_base_freq``, default
  1e4, ``rope_parameters.sliding_attention``): two pairs of cos/sin tables. ``rope_scaling``
  (linear, the published Gemma 3 files) changes only the values: priced as plain tables.
- embedding: ``Gemma*TextScaledWordEmbedding`` multiplies by sqrt(hidden_size) (one more
  (B, T, D) elementwise op); embeddings tied by default.
- Gemma 2 runs eager attention (``Gemma2PreTrainedModel._supports_sdpa`` is False): planned eager.

- soft-capping (Gemma 2's defaults 50 and 30; Gemma 3's null): ``attn_logit_softcapping`` caps the
  eager scores before the mask, ``final_logit_softcapping`` the logits before the loss, each
  ``c * tanh(x / c)`` (``planner.ops.gemma``). SDPA has no soft-capping: capped scores under flash
  attention are refused in one line (use eager).

Refused in one line naming the key: ``use_bidirectional_attention``, an activation other than gelu_pytorch_tanh, dropout above 0
(the planner's dropout also covers the embedding and residuals, which Gemma does not drop), rope
types other than default and linear. A gemma3 file's vision tower is not planned: a one-line
warning says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError, ConfigWarning
from planner.model.families.dense.reader import GATED_KEYS, gated_shape
from planner.model.families.dense.windows import listed_layer_types
from planner.model.families.fields import (
    FamilyReader,
    FamilySpec,
    Shape,
    hf_bool,
    hf_float,
    hf_int,
    hf_rope_theta,
    refuse_rope_types,
)
from planner.model.families.gemma.config import FILE_DEFAULTS, SECTIONS
from planner.model.kinds import Activation, AttentionImpl, LayerType, MlpKind, NormKind, NormPlacement, PositionKind

_COMMON: dict[str, Any] = {
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
# Gemma2Config's and Gemma3TextConfig's defaults (transformers 5.24.0); tests check them against the installed one
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {**_COMMON, "vocab_size": 256000, "max_position_embeddings": 8192, "rope_theta": 10000.0,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window_pattern": 2},
    "gemma3_text": {**_COMMON, "vocab_size": 262208, "max_position_embeddings": 131072, "rope_theta": 1e6,
                    "rope_local_base_freq": 10000.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window_pattern": 6},
}
_ROPE_TYPES = (None, "default", "linear")


def text_part(data: Mapping[str, Any], context: str) -> dict[str, Any]:
    """A multimodal ``gemma3`` file's ``text_config`` as a ``gemma3_text`` file (absent: the class
    defaults), with a one-line warning that the vision tower is not planned."""
    text = data.get("text_config")
    text = {} if text is None else text
    if not isinstance(text, Mapping):
        raise ConfigError(f"{context}: text_config: expected a mapping (Gemma3TextConfig's keys), got {text!r}")
    warnings.warn(f"{context}: model_type gemma3: its text model (text_config, as Gemma3ForCausalLM) is planned; the "
                  "SigLIP vision tower and multimodal projector (vision_config) are not", ConfigWarning, stacklevel=3)
    merged = {**text, "model_type": "gemma3_text"}
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in data:
        merged["tie_word_embeddings"] = data["tie_word_embeddings"]
    return merged


def _refusals(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> None:
    """One line naming the key of what is not priced."""
    if hf_bool(data, "use_bidirectional_attention", context, False):
        raise ConfigError(f"{context}: use_bidirectional_attention: bidirectional attention is not priced (decoder-"
                          "only causal models only); set it to false")
    # Gemma2MLP / Gemma3MLP run ACT2FN[config.hidden_activation]; hidden_act is never read
    act = data.get("hidden_activation") or defaults["hidden_activation"]
    if act != Activation.GELU_PYTORCH_TANH.value:
        raise ConfigError(f"{context}: hidden_activation: {act!r} is not supported; Gemma's GeGLU MLP is priced with "
                          "gelu_pytorch_tanh")
    if hf_float(data, "attention_dropout", context, defaults["attention_dropout"]):
        raise ConfigError(f"{context}: attention_dropout: Gemma's attention dropout is not priced (the planner's "
                          "dropout also drops the embedding and residual branches, which Gemma does not); set it to 0")


def _layer_types(data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], n_layers: int,
                 context: str) -> tuple[LayerType, ...]:
    """``layer_types``, else every ``sliding_window_pattern``-th layer full: Gemma2Config alternates
    (every 2nd full) whatever the file says; Gemma3TextConfig reads ``sliding_window_pattern``
    (default 6; also ``_sliding_window_pattern``) (transformers 5.24.0 ``configuration_gemma2.py``,
    ``configuration_gemma3.py`` ``__post_init__``)."""
    raw = data.get("layer_types")
    if raw is not None:
        return listed_layer_types(raw, n_layers, context)
    if model_type == "gemma2":  # the pattern is not read from the file
        pattern = 2
    else:
        key = "sliding_window_pattern" if data.get("sliding_window_pattern") is not None else "_sliding_window_pattern"
        pattern = hf_int(data, key, context, default=defaults["sliding_window_pattern"])
    return tuple(LayerType.SLIDING if (i + 1) % pattern else LayerType.FULL for i in range(n_layers))


def _nested_theta(data: Mapping[str, Any], layer_type: str, context: str) -> float | None:
    """``rope_parameters[layer_type].rope_theta`` (transformers 5 files), if there."""
    nested = data.get("rope_parameters")
    part = nested.get(layer_type) if isinstance(nested, Mapping) else None
    if isinstance(part, Mapping) and part.get("rope_theta") is not None:
        return hf_float(part, "rope_theta", f"{context}: rope_parameters: {layer_type}", 0.0)
    return None


def _rope_fields(data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], context: str
                 ) -> dict[str, Any]:
    """``rope_theta`` and (Gemma 3) ``rope_local_theta``; rope types other than default and linear refused."""
    fix = "use rope_type default or linear"
    refuse_rope_types({k: v for k, v in data.items() if k == "rope_scaling"}, context, _ROPE_TYPES,
                      "for gemma (default and linear cost plain RoPE tables)", fix)
    nested = data.get("rope_parameters")
    if model_type == "gemma2" or not isinstance(nested, Mapping) or "full_attention" not in nested:
        refuse_rope_types({k: v for k, v in data.items() if k == "rope_parameters"}, context, _ROPE_TYPES,
                          "for gemma (default and linear cost plain RoPE tables)", fix)
    else:
        for part in ("full_attention", "sliding_attention"):
            refuse_rope_types({"rope_parameters": nested.get(part)}, f"{context}: {part}", _ROPE_TYPES,
                              "for gemma (default and linear cost plain RoPE tables)", fix)
    if model_type == "gemma2":
        return {"rope_theta": hf_rope_theta(data, context, defaults["rope_theta"])}
    # Gemma3TextConfig: rope_parameters[...].setdefault("rope_theta", kwargs.pop("rope_theta", ...)): the
    # nested value wins, the top-level one fills in where it is missing
    full = _nested_theta(data, "full_attention", context)
    if full is None:
        full = hf_float(data, "rope_theta", context, defaults["rope_theta"])
    local = _nested_theta(data, "sliding_attention", context)
    if local is None:
        local = hf_float(data, "rope_local_base_freq", context, defaults["rope_local_base_freq"])
    return {"rope_theta": full, "rope_local_theta": local}


def _fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """gemma2's and gemma3_text's ModelConfig fields."""
    _refusals(data, defaults, context)
    bias = hf_bool(data, "attention_bias", context, defaults["attention_bias"])
    fields: dict[str, Any] = {
        "norm": NormKind.GEMMA_RMSNORM, "norm_placement": NormPlacement.SANDWICH, "mlp": MlpKind.GEGLU,
        "activation": Activation.GELU_PYTORCH_TANH, "positions": PositionKind.ROTARY, "scale_embeddings": True,
        "qkv_bias": bias, "attn_out_bias": bias, "mlp_bias": False,
        "norm_eps": hf_float(data, "rms_norm_eps", context, defaults["rms_norm_eps"]),
        "query_pre_attn_scalar": hf_float(data, "query_pre_attn_scalar", context, defaults["query_pre_attn_scalar"]),
        **_rope_fields(data, model_type, defaults, context),
    }
    if model_type == "gemma2":  # transformers runs Gemma 2 eagerly (no SDPA path)
        fields["attention"] = AttentionImpl.EAGER
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # c tanh(x / c): planner.ops.gemma
        if data.get(key, defaults[key]) is not None:
            fields[key] = hf_float(data, key, context, defaults[key])
    if "head_dim" in data and data["head_dim"] is None:
        raise ConfigError(f"{context}: head_dim: null is rejected by transformers' Gemma config (an int field); give "
                          f"the head size or omit it (default {defaults['head_dim']})")
    head_dim = hf_int(data, "head_dim", context, default=defaults["head_dim"])
    if head_dim * shape.n_heads != shape.d_model:
        fields["attention_head_dim"] = head_dim
    types = _layer_types(data, model_type, defaults, shape.n_layers, context)
    window = data.get("sliding_window", defaults["sliding_window"])
    if LayerType.SLIDING in types:
        if window is None:
            raise ConfigError(f"{context}: sliding_window: null, but layer_types has sliding_attention layers; give "
                              "the window or list full_attention only")
        window = hf_int(data, "sliding_window", context, default=defaults["sliding_window"])
        fields.update(sliding_window=window, layer_types=types)
    return fields


READER = FamilyReader(defaults=GEMMA_DEFAULTS, shape=gated_shape, fields=_fields, keys=GATED_KEYS)

# the family's registration (planner.model.families.registry)
FAMILY = FamilySpec(readers=(READER,), defaults=FILE_DEFAULTS, sections=SECTIONS)
