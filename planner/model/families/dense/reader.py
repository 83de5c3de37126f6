"""The dense families' transformers ``config.json`` (model_type gpt2, llama, mistral, qwen2, qwen3,
olmo2), and the Llama-like sizes and fields every other family's reader starts from.

transformers 5.24.0 (``models/<type>/configuration_<type>.py``, ``modeling_<type>.py``):
``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention`` and ``Qwen3Attention`` project
D -> N ``head_dim`` when the file sets ``head_dim`` (Mistral NeMo: 5120 -> 32 x 128; Qwen3's class
default is 128 whatever D / N is), and ``LlamaConfig`` still requires D divisible by N; GPT-2
reads no ``head_dim``. qwen3 is Qwen2's layout with ``attention_bias`` on q, k, v and o (default
false), RMSNorm over each head's ``head_dim`` values of q and k (``q_norm``/``k_norm``) and no MLP
bias. olmo2 (``Olmo2DecoderLayer``) norms each branch's output before its residual add
(``post_attention_layernorm``, ``post_feedforward_layernorm``: norm_placement post), RMSNorms q and
k over all heads (N ``head_dim`` and K ``head_dim`` wide: qk_norm full) and has ``attention_bias``
on q, k, v and o. Sliding windows (mistral, qwen2, qwen3) are read by
``planner.model.families.dense.windows``.

Keys a config.json may omit take transformers' own defaults (``HF_DEFAULTS``; tests check them
against the installed transformers). Every problem is a ``ConfigError`` naming the file and key.
``planner.model.families.registry`` dispatches a file to its family's reader (``GPT2``, ``GATED``
here) by ``model_type``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError
from planner.model.families.dense.config import FILE_DEFAULTS, SECTIONS
from planner.model.families.dense.windows import window_fields
from planner.model.families.fields import FamilyReader, FamilySpec, Shape
from planner.model.families.fields import hf_bool as _hf_bool
from planner.model.families.fields import hf_float as _hf_float
from planner.model.families.fields import hf_int as _hf_int
from planner.model.families.fields import hf_rope_theta as _hf_rope_theta
from planner.model.kinds import Activation, MlpKind, PositionKind, QkNorm

# transformers' defaults (its GPT2Config / LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config /
# Olmo2Config) for the keys a config.json may omit; tests check these against the installed transformers.
GPT2_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "n_positions": 1024, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
        "activation_function": "gelu_new", "resid_pdrop": 0.1,
    },
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
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
    "qwen3": {
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_dropout": 0.0, "rope_theta": 10000.0, "num_key_value_heads": 32,
        "head_dim": 128, "attention_bias": False,
    },
    "olmo2": {
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_dropout": 0.0, "rope_theta": 10000.0, "attention_bias": False,
    },
}

# ModelConfig fields -> the config.json keys the readers fill them from, for messages about a
# config.json (``rms_norm_eps``, not ``norm_eps``); every Llama-like family's reader uses GATED_KEYS
GPT2_KEYS = {"n_layers": "n_layer", "d_model": "n_embd", "n_heads": "n_head", "n_kv_heads": "n_head",
             "d_ff": "n_inner", "max_seq_len": "n_positions", "norm_eps": "layer_norm_epsilon",
             "dropout": "resid_pdrop", "tie_embeddings": "tie_word_embeddings", "activation": "activation_function"}
GATED_KEYS = {"n_layers": "num_hidden_layers", "d_model": "hidden_size", "n_heads": "num_attention_heads",
              "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size", "max_seq_len": "max_position_embeddings",
              "norm_eps": "rms_norm_eps", "dropout": "attention_dropout", "tie_embeddings": "tie_word_embeddings",
              "attention_head_dim": "head_dim", "activation": "hidden_act"}

# Activations priced as our MLP kinds. GPT-2's MLP is up -> GELU -> down: the reference model runs
# every variant as the fused tanh GELU (same shapes and FLOPs); the file's variant is kept as
# ``activation`` for implementation hf, where gelu_new and gelu_fast are written out in Python and
# save more. Llama-like MLPs are gated: silu (= swish) gives SwiGLU.
_GPT2_ACTS = frozenset({"gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"})
_GATED_ACTS = frozenset({"silu", "swish"})


def _gpt2_shape(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> Shape:
    """GPT-2's sizes (``n_layer``, ``n_embd``, ``n_head``, ``n_inner``, ``n_positions``); it is MHA."""
    n_layers = _hf_int(data, "n_layer", context)
    d_model = _hf_int(data, "n_embd", context)
    n_heads = _hf_int(data, "n_head", context)
    d_ff = _hf_int(data, "n_inner", context, default=4 * d_model)  # None: 4 * n_embd
    max_seq_len = _hf_int(data, "n_positions", context, default=defaults["n_positions"])
    return Shape(n_layers, d_model, n_heads, n_heads, d_ff, max_seq_len, "n_head", "n_head")


def _gpt2_fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
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


def gated_shape(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> Shape:
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
    return Shape(n_layers, d_model, n_heads, n_kv_heads, d_ff, max_seq_len, heads_key, kv_key)


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
    if model_type in ("qwen3", "olmo2"):  # attention_bias on q, k, v and o; their MLPs have no bias
        attn_bias = _hf_bool(data, "attention_bias", context, defaults["attention_bias"])
        return attn_bias, attn_bias, False
    # MistralAttention/MistralMLP have no bias switch: transformers ignores attention_bias here
    # (the other families' readers set their own biases)
    return False, False, False


def gated_fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], context: str, *, read_act: bool = True
) -> dict[str, Any]:
    """The fields every Llama-like type has: SwiGLU MLP, rotary positions, biases, RMSNorm eps, dropout
    (``read_act`` false: the file's ``hidden_act`` is read by nothing, as in gpt-oss)."""
    act = data.get("hidden_act") or defaults["hidden_act"]
    if read_act and (not isinstance(act, str) or act not in _GATED_ACTS):
        raise ConfigError(
            f"{context}: hidden_act: {act!r} is not supported; the gated MLP of {model_type} is priced as SwiGLU "
            f"and needs one of {', '.join(sorted(_GATED_ACTS))}"
        )
    qkv_bias, out_bias, mlp_bias = _gated_biases(data, model_type, defaults, context)
    return {
        "mlp": MlpKind.SWIGLU, "positions": PositionKind.ROTARY, "activation": Activation.SILU,
        "qkv_bias": qkv_bias, "attn_out_bias": out_bias, "mlp_bias": mlp_bias,
        "norm_eps": _hf_float(data, "rms_norm_eps", context, defaults["rms_norm_eps"]),
        "rope_theta": _hf_rope_theta(data, context, defaults["rope_theta"]),
        "dropout": _hf_float(data, "attention_dropout", context, defaults["attention_dropout"]),
    }


def _dense_fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """A dense Llama-like type's ModelConfig fields: the common ones, its sliding windows, its head dim."""
    fields = gated_fields(data, model_type, defaults, context)
    fields.update(window_fields(data, model_type, shape.n_layers, context))
    fields.update(_head_dim_fields(data, model_type, defaults, shape, context))
    return fields


def _head_dim_fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """``attention_head_dim`` where the file's ``head_dim`` (qwen3: its class default too) is not D / N,
    and qwen3's per-head q/k norms."""
    fields: dict[str, Any] = {"qk_norm": QkNorm.HEAD} if model_type == "qwen3" else {}
    if model_type == "qwen3" and "head_dim" in data and data["head_dim"] is None:
        raise ConfigError(f"{context}: head_dim: null is rejected by transformers' Qwen3Config (an int field); give "
                          "the head size or omit it (default 128)")
    if data.get("head_dim") is None and "head_dim" not in defaults:
        return fields  # hidden_size / num_attention_heads
    head_dim = _hf_int(data, "head_dim", context, default=defaults.get("head_dim"))
    if head_dim * shape.n_heads != shape.d_model:
        fields["attention_head_dim"] = head_dim
    return fields


GPT2 = FamilyReader(defaults=GPT2_DEFAULTS, shape=_gpt2_shape, fields=_gpt2_fields, keys=GPT2_KEYS)
GATED = FamilyReader(defaults=HF_DEFAULTS, shape=gated_shape, fields=_dense_fields, keys=GATED_KEYS)

# the family's registration (planner.model.families.registry)
FAMILY = FamilySpec(readers=(GPT2, GATED), defaults=FILE_DEFAULTS, sections=SECTIONS)
