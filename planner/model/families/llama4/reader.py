"""Llama 4's transformers configs (model_type llama4_text; llama4, the multimodal wrapper, read
through its ``text_config``): what they add to a Llama-like ``config.json``, read into
``ModelConfig`` fields (``moe``, ``llama4``, ``d_ff``, the attention biases, the head dim).

Mapped from transformers 5.24.0's ``models/llama4/configuration_llama4.py`` (``Llama4TextConfig``,
``Llama4Config``) and ``modeling_llama4.py``:

- blocks: block i is a MoE block iff i is in ``moe_layers`` (default: every
  ``interleave_moe_layer_step``-th, ``range(step - 1, L, step)``), else a dense SwiGLU MLP of
  ``intermediate_size_mlp`` (``Llama4TextMLP``); the planner holds the sparse blocks as
  ``first_dense_layers`` / ``every``, so a ``moe_layers`` list of another shape is refused.
- MoE block (``Llama4TextMoe``): ``num_local_experts`` experts of ``intermediate_size``
  (``Llama4TextExperts``: one fused ``gate_up_proj`` (E, D, 2I) and ``down_proj`` (E, I, D), run
  by ``bmm``), the router (``Llama4Router``: a D x E linear, no bias; the top
  ``num_experts_per_tok`` logits through an fp32 sigmoid, the others 0) whose scores multiply the
  experts' input, and a shared expert (``Llama4TextMLP`` of ``intermediate_size``, no gate) added
  to their sum. transformers runs every expert on every token (the scores zero the others); the
  planner prices the routed rows only, as the reference MoE block dispatches them
  (``validate.models.moe``: ``RouterScoring.TOPK_SIGMOID``, ``ExpertActivation.FUSED_SWIGLU``).
- attention (``Llama4TextAttention``): q, k, v and o biased by ``attention_bias``, ``head_dim``
  (class default 128), RoPE on the blocks whose ``no_rope_layers`` entry is 1 (default: all but
  every ``no_rope_layer_interval``-th), ``use_qk_norm``, ``attn_temperature_tuning``
  (``floor_scale``, ``attn_scale``) and ``attention_chunk_size`` as
  ``planner.model.families.llama4.config`` says.
- RoPE: ``rope_parameters``/``rope_scaling`` of type default or llama3 (llama3 rescales the
  frequencies only: the same tables, the same cost).
- ``output_router_logits``, ``router_aux_loss_coef`` and ``router_jitter_noise`` are read by
  nothing that trains in ``Llama4ForCausalLM`` (no load-balancing loss, no jitter): ignored.

The multimodal ``llama4`` file plans its text model only (``Llama4ForCausalLM`` over its
``text_config``); its vision tower and projector are not planned, and a warning says so in one line.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError, ConfigWarning
from planner.model.families.dense.reader import GATED_KEYS, gated_fields, gated_shape
from planner.model.families.fields import FamilyReader, FamilySpec, Shape, hf_bool, hf_float, hf_int, refuse_rope_types
from planner.model.families.llama4.config import FILE_DEFAULTS, SECTIONS
from planner.model.families.moe.config import ExpertActivation, RouterScoring

# Llama4TextConfig's defaults (transformers 5.24.0) for the keys a config.json may omit; tests check
# them against the installed transformers.
LLAMA4_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "attention_dropout": 0.0, "num_experts_per_tok": 1, "num_local_experts": 16, "interleave_moe_layer_step": 1,
    "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
    "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
    "rope_theta": 500000.0,  # Llama4TextConfig.default_theta
}
KEYS = {**GATED_KEYS, "d_ff": "intermediate_size_mlp"}
_ROPE_TYPES = (None, "default", "llama3")
_LAYER_TYPES = ("full_attention", "chunked_attention")


def text_part(data: Mapping[str, Any], context: str) -> dict[str, Any]:
    """A multimodal ``llama4`` file's ``text_config`` as a ``llama4_text`` file (absent: the
    class defaults), with a one-line warning that the vision tower is not planned."""
    text = data.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, Mapping):
        raise ConfigError(f"{context}: text_config: expected a mapping (Llama4TextConfig's keys), got {text!r}")
    warnings.warn(f"{context}: model_type llama4: its text model (text_config, as Llama4ForCausalLM) is planned; the "
                  "vision tower and multimodal projector (vision_config) are not", ConfigWarning, stacklevel=3)
    merged = {**text, "model_type": "llama4_text"}
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in data:
        merged["tie_word_embeddings"] = data["tie_word_embeddings"]
    return merged


def _shape(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> Shape:
    """The Llama-like sizes, the dense blocks' MLP being ``intermediate_size_mlp`` wide."""
    shape = gated_shape(data, defaults, context)
    key = "intermediate_size_mlp"
    return shape._replace(d_ff=hf_int(data, key, context, default=defaults[key]))


def _flag(data: Mapping[str, Any], key: str, context: str) -> bool:
    """A switch Meta's published files write as an integer (Scout's ``attn_temperature_tuning: 4``,
    read for its truth as transformers 4.51 did; 5.24.0's strict class wants a bool)."""
    value = data.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return bool(value)
    return hf_bool(data, key, context, LLAMA4_DEFAULTS[key])


def _sparse_layout(data: Mapping[str, Any], n_layers: int, context: str) -> tuple[int, int]:
    """(first_dense_layers, every) giving exactly the MoE blocks: ``moe_layers``, else every
    ``interleave_moe_layer_step``-th block."""
    step = hf_int(data, "interleave_moe_layer_step", context, default=LLAMA4_DEFAULTS["interleave_moe_layer_step"])
    raw = data.get("moe_layers")
    if raw is None:
        raw = list(range(step - 1, n_layers, step))
    if not isinstance(raw, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in raw):
        raise ConfigError(f"{context}: moe_layers: expected a list of block indices, got {raw!r}")
    sparse = {i for i in raw if 0 <= i < n_layers}
    for every in range(1, n_layers + 1):
        for first in range(n_layers):
            if sparse == {i for i in range(first, n_layers) if (i + 1) % every == 0}:
                return first, every
    raise ConfigError(f"{context}: moe_layers: MoE blocks {sorted(sparse)} are not every n-th block after a leading "
                      "run of dense ones (the layouts the planner holds); list such a set, e.g. every "
                      "interleave_moe_layer_step-th block")


def _nope_layers(data: Mapping[str, Any], n_layers: int, context: str) -> tuple[int, ...]:
    """The blocks without RoPE: ``no_rope_layers[i]`` 0 (absent or empty: every
    ``no_rope_layer_interval``-th block, as ``Llama4TextConfig.__post_init__``)."""
    raw = data.get("no_rope_layers")
    if not raw:
        interval = hf_int(data, "no_rope_layer_interval", context, default=LLAMA4_DEFAULTS["no_rope_layer_interval"])
        return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)
    if not isinstance(raw, list) or any(flag not in (0, 1) or isinstance(flag, float) for flag in raw):
        raise ConfigError(f"{context}: no_rope_layers: expected a list of 1 (RoPE) and 0 (no RoPE), got {raw!r}")
    if len(raw) < n_layers:
        raise ConfigError(f"{context}: no_rope_layers: {len(raw)} entries for num_hidden_layers {n_layers}; list "
                          "one per layer")
    return tuple(i for i in range(n_layers) if not raw[i])


def _chunk(data: Mapping[str, Any], n_layers: int, nope: tuple[int, ...], context: str) -> int | None:
    """The chunk of the chunked blocks (``layer_types``, default: the RoPE blocks while
    ``attention_chunk_size`` is set); None when no block is chunked."""
    key = "attention_chunk_size"
    chunk = None if key in data and data[key] is None else hf_int(data, key, context,
                                                                   default=LLAMA4_DEFAULTS[key])
    raw = data.get("layer_types")
    if raw is None:
        chunked = chunk is not None and len(nope) < n_layers
    elif not isinstance(raw, list) or len(raw) != n_layers or any(t not in _LAYER_TYPES for t in raw):
        raise ConfigError(f"{context}: layer_types: expected one of {' or '.join(_LAYER_TYPES)} per layer "
                          f"({n_layers}), got {raw!r}")
    else:
        chunked = "chunked_attention" in raw
        if chunked and chunk is None:
            raise ConfigError(f"{context}: layer_types: chunked_attention layers need attention_chunk_size; set it "
                              "or list full_attention only")
    return chunk if chunked else None


def llama4_fields(data: Mapping[str, Any], *, n_layers: int, d_model: int, n_heads: int, context: str
                  ) -> dict[str, Any]:
    """The ModelConfig fields of a llama4_text config.json beyond the Llama-like ones."""
    d = LLAMA4_DEFAULTS
    if "num_key_value_heads" in data and data["num_key_value_heads"] is None:
        raise ConfigError(f"{context}: num_key_value_heads: null is rejected by transformers' Llama4TextConfig (an int "
                          "field); give the number of KV heads")
    refuse_rope_types(data, context, _ROPE_TYPES, "for llama4_text (llama3 rescales frequencies: the same cost)",
                      "use rope_type default or llama3")
    n_experts = hf_int(data, "num_local_experts", context, default=d["num_local_experts"])
    top_k = hf_int(data, "num_experts_per_tok", context, default=d["num_experts_per_tok"])
    if top_k > n_experts:
        raise ConfigError(f"{context}: num_experts_per_tok: {top_k} exceeds num_local_experts = {n_experts}; a token "
                          "is routed to at most every expert")
    expert_size = hf_int(data, "intermediate_size", context, default=d["intermediate_size"])
    first, every = _sparse_layout(data, n_layers, context)
    moe = {"n_experts": n_experts, "top_k": top_k, "d_ff_expert": expert_size, "shared_d_ff": expert_size,
           "norm_topk_prob": False, "scoring": RouterScoring.TOPK_SIGMOID, "first_dense_layers": first,
           "every": every, "expert_activation": ExpertActivation.FUSED_SWIGLU}
    nope = _nope_layers(data, n_layers, context)
    llama4 = {
        "nope_layers": nope, "qk_l2_norm": hf_bool(data, "use_qk_norm", context, d["use_qk_norm"]),
        "temperature_tuning": _flag(data, "attn_temperature_tuning", context),
        "floor_scale": hf_int(data, "floor_scale", context, default=d["floor_scale"]),
        "attn_scale": hf_float(data, "attn_scale", context, d["attn_scale"]),
        "attention_chunk_size": _chunk(data, n_layers, nope, context),
    }
    bias = hf_bool(data, "attention_bias", context, d["attention_bias"])
    fields: dict[str, Any] = {"moe": moe, "llama4": llama4, "qkv_bias": bias, "attn_out_bias": bias,
                              "mlp_bias": False}
    # head_dim: absent takes the class default (128); null: hidden_size / num_attention_heads
    head_dim = d_model // n_heads if "head_dim" in data and data["head_dim"] is None else hf_int(
        data, "head_dim", context, default=d["head_dim"])
    if head_dim * n_heads != d_model:
        fields["attention_head_dim"] = head_dim
    return fields


def _fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """llama4_text's ModelConfig fields: the Llama-like ones, then its own."""
    fields = gated_fields(data, model_type, defaults, context)
    fields.update(llama4_fields(data, n_layers=shape.n_layers, d_model=shape.d_model, n_heads=shape.n_heads,
                                context=context))
    return fields


READER = FamilyReader(defaults={"llama4_text": LLAMA4_DEFAULTS}, shape=_shape, fields=_fields, keys=KEYS)

# the family's registration (planner.model.families.registry)
FAMILY = FamilySpec(readers=(READER,), defaults=FILE_DEFAULTS, sections=SECTIONS)
