"""Read a transformers ``config.json`` as a ModelConfig: its ``model_type`` names the family whose
reader reads it (``planner.model.families.registry.READERS``: model_type gpt2, llama, mistral,
qwen2, qwen3, olmo2, and the mixture-of-experts mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3,
gpt_oss, phi3, gemma2, gemma3_text, and a gemma3 file's text model); a few others would be named and
refused (``REFUSED_TYPES``).

Every problem is a ``ConfigError`` naming the file and key; keys a file may omit take
transformers' own defaults for its model type (each reader's ``defaults``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hardware.validation import describe_validation_error
from planner.errors import ConfigError
from planner.model.config import Family, ModelConfig
from planner.model.families.fields import Shape
from planner.model.families.fields import hf_bool as _hf_bool
from planner.model.families.fields import hf_int as _hf_int
from planner.model.families.gemma.reader import text_part as gemma3_text_part
from planner.model.families.llama4.reader import text_part as llama4_text_part
from planner.model.families.registry import HF_TYPES, READERS

# Model types read far enough to say why they cannot be planned (transformers 5.24.0's
# modeling_<type>.py): what each runs that the planner does not price.
REFUSED_TYPES: dict[str, str] = {}


def _checked_model_type(data: Any, context: str) -> str:
    """The file's ``model_type``, after checking ``data`` is an object and the type is one we read."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{context}: expected a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if isinstance(model_type, str) and model_type in REFUSED_TYPES:
        raise ConfigError(f"{context}: model_type: {model_type}: {REFUSED_TYPES[model_type]}")
    if model_type not in HF_TYPES:
        raise ConfigError(
            f"{context}: model_type: {model_type!r} is not supported; supported model types: {', '.join(HF_TYPES)}"
        )
    return model_type


def _check_heads(
    data: Mapping[str, Any], model_type: str, shape: Shape, fields: Mapping[str, Any], context: str
) -> None:
    """Refuse GPT-2's explicit head dim (its attention reads none), a hidden size the heads do not
    divide (unless the type sets its own head dim or uses MLA; LlamaConfig requires it anyway) and
    query heads the KV heads do not divide."""
    d_model, n_heads, heads_key = shape.d_model, shape.n_heads, shape.heads_key
    head_dim = data.get("head_dim")
    if model_type == "gpt2" and head_dim is not None and head_dim != d_model / n_heads:
        raise ConfigError(
            f"{context}: head_dim: {head_dim!r} differs from n_embd / {heads_key} = {d_model} / {n_heads}; GPT-2's "
            "attention splits n_embd into n_head heads and an explicit head dim is not supported"
        )
    own_dim = (fields.get("attention_head_dim") or fields.get("mla")) and model_type != "llama"
    if d_model % n_heads and not own_dim:
        raise ConfigError(f"{context}: {heads_key}: hidden size {d_model} is not divisible by {n_heads} heads")
    if n_heads % shape.n_kv_heads:
        raise ConfigError(
            f"{context}: {shape.kv_key}: {n_heads} attention heads are not divisible by {shape.n_kv_heads} KV heads"
        )


def model_from_hf_config(
    data: Mapping[str, Any], name: str = "custom", *, context: str = "transformers config"
) -> ModelConfig:
    """A ModelConfig from a transformers ``config.json`` (model_type gpt2, llama, mistral, qwen2, qwen3,
    olmo2, mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss).

    Everything comes from the file; keys it omits take transformers' defaults for its model type.
    """
    if isinstance(data, Mapping) and data.get("model_type") == "llama4":  # the multimodal wrapper: its text model
        data = llama4_text_part(data, context)
    if isinstance(data, Mapping) and data.get("model_type") == "gemma3":  # the multimodal wrapper: its text model
        data = gemma3_text_part(data, context)
    model_type = _checked_model_type(data, context)
    reader = READERS[model_type]
    defaults = reader.defaults[model_type]
    shape = reader.shape(data, defaults, context)
    fields = reader.fields(data, model_type, defaults, shape, context)
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
        raise ConfigError(describe_validation_error(error, context, reader.keys)) from None


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
