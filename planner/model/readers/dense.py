"""Read a transformers ``config.json`` (model_type gpt2, llama, mistral, qwen2, and the mixture-of-
experts mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss) as a ModelConfig.

Keys a config.json may omit take transformers' own defaults (``_HF_DEFAULTS``; tests check them
against the installed transformers). Every problem is a ``ConfigError`` naming the file and key.
The MoE types' own fields are read by ``planner.model.readers.moe``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from hardware.validation import describe_validation_error
from planner.errors import ConfigError
from planner.model.config import Activation, Family, MlpKind, ModelConfig, PositionKind
from planner.model.readers.fields import hf_bool as _hf_bool
from planner.model.readers.fields import hf_float as _hf_float
from planner.model.readers.fields import hf_int as _hf_int
from planner.model.readers.fields import hf_rope_theta as _hf_rope_theta
from planner.model.readers.moe import MOE_DEFAULTS, MOE_TYPES, REFUSED_TYPES, moe_fields

_HF_TYPES = ("gpt2", "llama", "mistral", "qwen2", *MOE_TYPES)

# transformers' defaults (its GPT2Config / LlamaConfig / MistralConfig / Qwen2Config; the MoE types'
# in planner.model.readers.moe) for the keys a config.json may omit; tests check these against the
# installed transformers.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "n_positions": 1024, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
        "activation_function": "gelu_new", "resid_pdrop": 0.1,
    },
    "llama": {
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_dropout": 0.0, "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0,
    },
    "mistral": {
        "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_dropout": 0.0, "rope_theta": 10000.0, "num_key_value_heads": 8,
    },
    "qwen2": {
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_dropout": 0.0, "rope_theta": 10000.0, "num_key_value_heads": 32,
    },
    **MOE_DEFAULTS,
}

# Activations priced as our MLP kinds. GPT-2's MLP is up -> GELU -> down: the reference model runs
# every variant as the fused tanh GELU (same shapes and FLOPs); the file's variant is kept as
# ``activation`` for implementation hf, where gelu_new and gelu_fast are written out in Python and
# save more. Llama-like MLPs are gated: silu (= swish) gives SwiGLU.
_GPT2_ACTS = frozenset({"gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"})
_GATED_ACTS = frozenset({"silu", "swish"})


class _Shape(NamedTuple):
    """The sizes every model type has, with the file keys its head counts came from (for messages)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    heads_key: str
    kv_key: str


def _checked_model_type(data: Any, context: str) -> str:
    """The file's ``model_type``, after checking ``data`` is an object and the type is one we read."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{context}: expected a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if isinstance(model_type, str) and model_type in REFUSED_TYPES:
        raise ConfigError(f"{context}: model_type: {model_type}: {REFUSED_TYPES[model_type]}")
    if model_type not in _HF_TYPES:
        raise ConfigError(
            f"{context}: model_type: {model_type!r} is not supported; supported model types: {', '.join(_HF_TYPES)}"
        )
    return model_type


def _gpt2_shape(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> _Shape:
    """GPT-2's sizes (``n_layer``, ``n_embd``, ``n_head``, ``n_inner``, ``n_positions``); it is MHA."""
    n_layers = _hf_int(data, "n_layer", context)
    d_model = _hf_int(data, "n_embd", context)
    n_heads = _hf_int(data, "n_head", context)
    d_ff = _hf_int(data, "n_inner", context, default=4 * d_model)  # None: 4 * n_embd
    max_seq_len = _hf_int(data, "n_positions", context, default=defaults["n_positions"])
    return _Shape(n_layers, d_model, n_heads, n_heads, d_ff, max_seq_len, "n_head", "n_head")


def _gpt2_fields(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> dict[str, Any]:
    """GPT-2's remaining ModelConfig fields: GELU MLP, learned positions, every bias, LayerNorm eps, dropout."""
    act_key = "activation_function"
    act = data.get(act_key) or defaults[act_key]
    if not isinstance(act, str) or act not in _GPT2_ACTS:
        raise ConfigError(
            f"{context}: {act_key}: {act!r} is not supported for gpt2; use one of {', '.join(sorted(_GPT2_ACTS))}"
        )
    if _hf_bool(data, "add_cross_attention", context, False):
        raise ConfigError(f"{context}: add_cross_attention: cross-attention is not supported (decoder-only models only)")
    return {
        "mlp": MlpKind.GELU, "positions": PositionKind.LEARNED, "activation": Activation(act),
        "qkv_bias": True, "attn_out_bias": True, "mlp_bias": True, "norm_bias": True,  # GPT-2 has every bias
        "norm_eps": _hf_float(data, "layer_norm_epsilon", context, defaults["layer_norm_epsilon"]),
        "dropout": _hf_float(data, "resid_pdrop", context, defaults["resid_pdrop"]),
    }


def _gated_shape(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> _Shape:
    """The sizes of the Llama-like types: required, except where the config class has a default
    (GptOssConfig gives every size one); ``num_key_value_heads`` null means MHA."""
    n_layers = _hf_int(data, "num_hidden_layers", context, default=defaults.get("num_hidden_layers"))
    d_model = _hf_int(data, "hidden_size", context, default=defaults.get("hidden_size"))
    heads_key = "num_attention_heads"
    n_heads = _hf_int(data, heads_key, context, default=defaults.get(heads_key))
    kv_key = "num_key_value_heads"
    if kv_key in data:  # null means one KV head per query head (MHA)
        n_kv_heads = _hf_int(data, kv_key, context, default=n_heads)
    else:  # absent: the config class's default (MistralConfig 8, Qwen2Config 32, LlamaConfig MHA)
        n_kv_heads = defaults.get(kv_key) or n_heads
    d_ff = _hf_int(data, "intermediate_size", context, default=defaults.get("intermediate_size"))
    max_seq_len = _hf_int(data, "max_position_embeddings", context, default=defaults["max_position_embeddings"])
    return _Shape(n_layers, d_model, n_heads, n_kv_heads, d_ff, max_seq_len, heads_key, kv_key)


def _gated_biases(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], context: str
) -> tuple[bool, bool, bool]:
    """(qkv, attention-output, MLP) bias of a Llama-like type's dense layers."""
    if model_type == "llama":
        # LlamaAttention: attention_bias sets the bias of q, k, v AND o_proj; mlp_bias of gate/up/down
        attn_bias = _hf_bool(data, "attention_bias", context, defaults["attention_bias"])
        return attn_bias, attn_bias, _hf_bool(data, "mlp_bias", context, defaults["mlp_bias"])
    if model_type == "qwen2":
        return True, False, False  # Qwen2Attention: q/k/v biased, o_proj not
    # MistralAttention/MistralMLP have no bias switch: transformers ignores attention_bias here
    # (the MoE types' biases are set by moe_fields)
    return False, False, False


def _gated_fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: _Shape, context: str
) -> dict[str, Any]:
    """A Llama-like type's remaining ModelConfig fields: SwiGLU MLP, rotary positions, biases, RMSNorm eps,
    dropout, and for the MoE types their own fields."""
    act = data.get("hidden_act") or defaults["hidden_act"]
    if model_type != "gpt_oss" and (not isinstance(act, str) or act not in _GATED_ACTS):  # gpt-oss reads none
        raise ConfigError(
            f"{context}: hidden_act: {act!r} is not supported; the gated MLP of {model_type} is priced as SwiGLU "
            f"and needs one of {', '.join(sorted(_GATED_ACTS))}"
        )
    qkv_bias, out_bias, mlp_bias = _gated_biases(data, model_type, defaults, context)
    fields = {
        "mlp": MlpKind.SWIGLU, "positions": PositionKind.ROTARY, "activation": Activation.SILU,
        "qkv_bias": qkv_bias, "attn_out_bias": out_bias, "mlp_bias": mlp_bias,
        "norm_eps": _hf_float(data, "rms_norm_eps", context, defaults["rms_norm_eps"]),
        "rope_theta": _hf_rope_theta(data, context, defaults["rope_theta"]),
        "dropout": _hf_float(data, "attention_dropout", context, defaults["attention_dropout"]),
    }
    if model_type in MOE_TYPES:
        fields.update(moe_fields(data, model_type, n_layers=shape.n_layers, d_model=shape.d_model,
                                 n_heads=shape.n_heads, d_ff=shape.d_ff, context=context))
    return fields


def _check_heads(
    data: Mapping[str, Any], model_type: str, shape: _Shape, fields: Mapping[str, Any], context: str
) -> None:
    """Refuse an explicit head dim (dense types), a hidden size the heads do not divide (unless the type
    sets its own head dim or uses MLA) and query heads the KV heads do not divide."""
    d_model, n_heads, heads_key = shape.d_model, shape.n_heads, shape.heads_key
    head_dim = data.get("head_dim")
    if model_type not in MOE_TYPES and head_dim is not None and head_dim != d_model / n_heads:
        raise ConfigError(
            f"{context}: head_dim: {head_dim!r} differs from {'n_embd' if model_type == 'gpt2' else 'hidden_size'} / "
            f"{heads_key} = {d_model} / {n_heads}; an explicit head dim is not supported"
        )
    if d_model % n_heads and not fields.get("attention_head_dim") and not fields.get("mla"):
        raise ConfigError(f"{context}: {heads_key}: hidden size {d_model} is not divisible by {n_heads} heads")
    if n_heads % shape.n_kv_heads:
        raise ConfigError(
            f"{context}: {shape.kv_key}: {n_heads} attention heads are not divisible by {shape.n_kv_heads} KV heads"
        )


def model_from_hf_config(
    data: Mapping[str, Any], name: str = "custom", *, context: str = "transformers config"
) -> ModelConfig:
    """A ModelConfig from a transformers ``config.json`` (model_type gpt2, llama, mistral, qwen2,
    mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss).

    Everything comes from the file; keys it omits take transformers' defaults for its model type.
    """
    model_type = _checked_model_type(data, context)
    defaults = _HF_DEFAULTS[model_type]
    if model_type == "gpt2":
        shape = _gpt2_shape(data, defaults, context)
        fields = _gpt2_fields(data, defaults, context)
    else:
        shape = _gated_shape(data, defaults, context)
        fields = _gated_fields(data, model_type, defaults, shape, context)
    _check_heads(data, model_type, shape, fields, context)
    raw = dict(
        name=name, family=Family(model_type), n_layers=shape.n_layers, d_model=shape.d_model, n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads, d_ff=shape.d_ff,
        vocab_size=_hf_int(data, "vocab_size", context, default=defaults.get("vocab_size")),
        max_seq_len=shape.max_seq_len,
        tie_embeddings=_hf_bool(data, "tie_word_embeddings", context, defaults["tie_word_embeddings"]),
        **fields,
    )
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, context)) from None


def hf_name(data: Mapping[str, Any], path: Path | None) -> str:
    """A label for a config.json: its ``_name_or_path``, else its folder (for config.json) or stem."""
    label = data.get("_name_or_path")
    if isinstance(label, str) and label.strip():
        return label.rstrip("/").rsplit("/", 1)[-1]
    if path is None:
        return "custom"
    if path.stem == "config" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem
