"""Load what the user names with ``--model``: a preset, a YAML/JSON file, a transformers config.json.

Accepted forms (``load_workload``):

- a bundled preset name (``llama3-8b``; ``list_presets()`` lists them);
- a YAML (or JSON) file with a ``model:`` section (ModelConfig fields, required) and a
  ``training:`` section (TrainConfig fields, optional). ``model:`` may also name a preset and
  override some of its fields, ``model: {preset: llama3-8b, attention: eager}``; the preset's
  training section is then inherited, field by field, unless the file's ``training:`` says
  otherwise. ``model: llama3-8b`` is short for ``model: {preset: llama3-8b}``;
- a transformers ``config.json`` (recognised by its ``model_type`` key) of model_type gpt2,
  llama, mistral or qwen2; it carries no training section;
- a mapping in either of those forms, a ``ModelConfig`` or a ``Workload``.

``resolve`` applies the CLI's overrides (``--seq-len``, ``--global-batch``, attention, dropout)
and returns the ``(ModelConfig, TrainConfig)`` pair the planner works on.

Every problem is a ``ConfigError`` (``UnknownPresetError`` for a name that is neither a preset
nor a file) whose one-line message names the file and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from hardware.validation import describe_validation_error
from planner.config import (
    AttentionImpl,
    Family,
    MlpKind,
    ModelConfig,
    PositionKind,
    TrainConfig,
)
from planner.errors import ConfigError, UnknownPresetError

_PRESET_DIR = "presets"
_SECTIONS = ("model", "training")

# Flags of the CLI that supply each training field when a file has none.
_TRAINING_FLAGS = {"seq_len": "--seq-len", "global_batch_size": "--global-batch"}


class Workload(BaseModel):
    """A model and, when the source gave one, its default training workload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig
    training: TrainConfig | None = None


# --------------------------------------------------------------------------------------------
# presets


def _preset_dir() -> Path:
    return Path(str(resources.files("planner").joinpath(_PRESET_DIR)))


@cache
def list_presets() -> tuple[str, ...]:
    """Names of the bundled model presets, sorted."""
    return tuple(sorted(p.stem for p in _preset_dir().glob("*.yaml")))


def _unknown_preset(name: str, where: str) -> UnknownPresetError:
    return UnknownPresetError(
        f"{where}: unknown preset {name!r}; presets: {', '.join(list_presets())} "
        "(or give a path to a YAML/JSON model file or a transformers config.json)"
    )


@cache
def _preset_sections(name: str) -> dict[str, Any]:
    """The raw (unvalidated) sections of a bundled preset."""
    if name not in list_presets():
        raise _unknown_preset(name, "model")
    path = _preset_dir() / f"{name}.yaml"
    data = _parse_file(path, f"preset {name}")
    if not isinstance(data, dict):
        raise ConfigError(f"preset {name}: expected a mapping with model: and training: sections")
    return data


@cache
def load_preset(name: str) -> Workload:
    """The bundled preset ``name`` (model and its documented default training workload)."""
    return _workload_from_sections(_preset_sections(name), f"preset {name}")


# --------------------------------------------------------------------------------------------
# transformers config.json

_HF_TYPES = ("gpt2", "llama", "mistral", "qwen2")

# transformers' defaults (its GPT2Config / LlamaConfig / MistralConfig / Qwen2Config) for the keys
# a config.json may omit; tests check these against the installed transformers.
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
}

# Activations priced as our MLP kinds. GPT-2's MLP is up -> GELU -> down: the tanh approximations
# (gelu_new, gelu_pytorch_tanh, gelu_fast) are what the reference model runs, exact "gelu" has the
# same shapes and cost. Llama-like MLPs are gated: silu (= swish) gives SwiGLU.
_GPT2_ACTS = frozenset({"gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"})
_GATED_ACTS = frozenset({"silu", "swish"})


def _hf_int(data: Mapping[str, Any], key: str, context: str, default: int | None = None) -> int:
    value = data.get(key)
    if value is None:
        if default is not None:
            return default
        raise ConfigError(f"{context}: {key}: required field is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{context}: {key}: expected a positive integer, got {value!r}")
    return value


def _hf_float(data: Mapping[str, Any], key: str, context: str, default: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{context}: {key}: expected a number, got {value!r}")
    return float(value)


def _hf_bool(data: Mapping[str, Any], key: str, context: str, default: bool) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{context}: {key}: expected true or false, got {value!r}")
    return value


def _hf_rope_theta(data: Mapping[str, Any], context: str, default: float) -> float:
    """Top-level ``rope_theta`` (transformers 4 files), else inside ``rope_parameters`` (transformers
    5 nests it there) or ``rope_scaling``."""
    if data.get("rope_theta") is not None:
        return _hf_float(data, "rope_theta", context, default)
    for key in ("rope_parameters", "rope_scaling"):
        nested = data.get(key)
        if isinstance(nested, Mapping) and nested.get("rope_theta") is not None:
            return _hf_float(nested, "rope_theta", f"{context}: {key}", default)
    return default


def model_from_hf_config(
    data: Mapping[str, Any], name: str = "custom", *, context: str = "transformers config"
) -> ModelConfig:
    """A ModelConfig from a transformers ``config.json`` (model_type gpt2, llama, mistral, qwen2).

    Everything comes from the file; keys it omits take transformers' defaults for its model type.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{context}: expected a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type not in _HF_TYPES:
        raise ConfigError(
            f"{context}: model_type: {model_type!r} is not supported; supported model types: {', '.join(_HF_TYPES)}"
        )
    defaults = _HF_DEFAULTS[model_type]
    if model_type == "gpt2":
        n_layers = _hf_int(data, "n_layer", context)
        d_model = _hf_int(data, "n_embd", context)
        heads_key, n_heads = "n_head", _hf_int(data, "n_head", context)
        kv_key, n_kv_heads = heads_key, n_heads
        d_ff = _hf_int(data, "n_inner", context, default=4 * d_model)  # None: 4 * n_embd
        max_seq_len = _hf_int(data, "n_positions", context, default=defaults["n_positions"])
        act_key = "activation_function"
        act = data.get(act_key) or defaults[act_key]
        if not isinstance(act, str) or act not in _GPT2_ACTS:
            raise ConfigError(
                f"{context}: {act_key}: {act!r} is not supported for gpt2; use one of {', '.join(sorted(_GPT2_ACTS))}"
            )
        if _hf_bool(data, "add_cross_attention", context, False):
            raise ConfigError(f"{context}: add_cross_attention: cross-attention is not supported (decoder-only models only)")
        fields: dict[str, Any] = {
            "mlp": MlpKind.GELU, "positions": PositionKind.LEARNED,
            "qkv_bias": True, "attn_out_bias": True, "mlp_bias": True, "norm_bias": True,  # GPT-2 has every bias
            "norm_eps": _hf_float(data, "layer_norm_epsilon", context, defaults["layer_norm_epsilon"]),
            "dropout": _hf_float(data, "resid_pdrop", context, defaults["resid_pdrop"]),
        }
    else:
        n_layers = _hf_int(data, "num_hidden_layers", context)
        d_model = _hf_int(data, "hidden_size", context)
        heads_key, n_heads = "num_attention_heads", _hf_int(data, "num_attention_heads", context)
        kv_key = "num_key_value_heads"
        if kv_key in data:  # null means one KV head per query head (MHA)
            n_kv_heads = _hf_int(data, kv_key, context, default=n_heads)
        else:  # absent: the config class's default (MistralConfig 8, Qwen2Config 32, LlamaConfig MHA)
            n_kv_heads = defaults.get(kv_key) or n_heads
        d_ff = _hf_int(data, "intermediate_size", context)
        max_seq_len = _hf_int(data, "max_position_embeddings", context, default=defaults["max_position_embeddings"])
        act = data.get("hidden_act") or defaults["hidden_act"]
        if not isinstance(act, str) or act not in _GATED_ACTS:
            raise ConfigError(
                f"{context}: hidden_act: {act!r} is not supported; the gated MLP of {model_type} is priced as SwiGLU "
                f"and needs one of {', '.join(sorted(_GATED_ACTS))}"
            )
        if model_type == "llama":
            # LlamaAttention: attention_bias sets the bias of q, k, v AND o_proj; mlp_bias of gate/up/down
            attn_bias = _hf_bool(data, "attention_bias", context, defaults["attention_bias"])
            qkv_bias, out_bias = attn_bias, attn_bias
            mlp_bias = _hf_bool(data, "mlp_bias", context, defaults["mlp_bias"])
        elif model_type == "qwen2":
            qkv_bias, out_bias, mlp_bias = True, False, False  # Qwen2Attention: q/k/v biased, o_proj not
        else:
            # MistralAttention/MistralMLP have no bias switch: transformers ignores attention_bias here
            qkv_bias, out_bias, mlp_bias = False, False, False
        fields = {
            "mlp": MlpKind.SWIGLU, "positions": PositionKind.ROTARY,
            "qkv_bias": qkv_bias, "attn_out_bias": out_bias, "mlp_bias": mlp_bias,
            "norm_eps": _hf_float(data, "rms_norm_eps", context, defaults["rms_norm_eps"]),
            "rope_theta": _hf_rope_theta(data, context, defaults["rope_theta"]),
            "dropout": _hf_float(data, "attention_dropout", context, defaults["attention_dropout"]),
        }
    head_dim = data.get("head_dim")
    if head_dim is not None and head_dim != d_model / n_heads:
        raise ConfigError(
            f"{context}: head_dim: {head_dim!r} differs from {'n_embd' if model_type == 'gpt2' else 'hidden_size'} / "
            f"{heads_key} = {d_model} / {n_heads}; an explicit head dim is not supported"
        )
    if d_model % n_heads:
        raise ConfigError(f"{context}: {heads_key}: hidden size {d_model} is not divisible by {n_heads} heads")
    if n_heads % n_kv_heads:
        raise ConfigError(f"{context}: {kv_key}: {n_heads} attention heads are not divisible by {n_kv_heads} KV heads")
    raw = dict(
        name=name, family=Family(model_type), n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_kv_heads=n_kv_heads, d_ff=d_ff, vocab_size=_hf_int(data, "vocab_size", context), max_seq_len=max_seq_len,
        tie_embeddings=_hf_bool(data, "tie_word_embeddings", context, defaults["tie_word_embeddings"]),
        **fields,
    )
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, context)) from None


def _hf_name(data: Mapping[str, Any], path: Path | None) -> str:
    """A label for a config.json: its ``_name_or_path``, else its folder (for config.json) or stem."""
    label = data.get("_name_or_path")
    if isinstance(label, str) and label.strip():
        return label.rstrip("/").rsplit("/", 1)[-1]
    if path is None:
        return "custom"
    if path.stem == "config" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


# --------------------------------------------------------------------------------------------
# files and mappings


def _parse_file(path: Path, context: str) -> Any:
    """Parsed YAML (or JSON for ``.json``); malformed input names the line."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{context}: cannot read the file: {error.strerror or error}") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{context}: line {error.lineno}: malformed JSON ({error.msg})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{context}:{where} malformed YAML ({problem})") from None


def _as_section(value: Any, section: str, context: str, hint: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{context}: {section}: expected a mapping of fields ({hint}), got {type(value).__name__}")
    return dict(value)


def _workload_from_sections(data: Any, context: str) -> Workload:
    """Validate a ``{model: ..., training: ...}`` mapping (or a transformers config.json mapping)."""
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{context}: expected a mapping with a model: section (and optionally training:), got {got}")
    if "model_type" in data:
        return Workload(model=model_from_hf_config(data, _hf_name(data, None), context=context))
    unknown = [key for key in data if key not in _SECTIONS]
    if unknown:
        raise ConfigError(
            f"{context}: {unknown[0]}: unknown top-level key; a model file has only model: and training: sections "
            "(model fields go under model:, or give a transformers config.json with its model_type)"
        )
    if data.get("model") is None:
        raise ConfigError(f"{context}: model: required section is missing")
    model = data["model"]
    if isinstance(model, str):
        model = {"preset": model}
    model = _as_section(model, "model", context, "ModelConfig fields, or preset: NAME plus fields to override")
    training_raw = data.get("training")
    training = None if training_raw is None else _as_section(training_raw, "training", context, "seq_len, global_batch_size, ...")
    if "preset" in model:
        preset = model.pop("preset")
        if not isinstance(preset, str) or preset not in list_presets():
            raise _unknown_preset(str(preset), f"{context}: model.preset")
        base = _preset_sections(preset)
        model = {**base["model"], **model}
        base_training = base.get("training")
        if base_training is not None:
            training = {**base_training, **(training or {})}
    try:
        return Workload.model_validate({"model": model, "training": training})
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, context)) from None


def _load_path(path: Path, shown: str) -> Workload:
    if not path.exists():
        raise UnknownPresetError(
            f"model: {shown}: no such file and not a preset; presets: {', '.join(list_presets())} "
            "(or give a path to a YAML/JSON model file or a transformers config.json)"
        )
    data = _parse_file(path, f"model file {shown}")
    if isinstance(data, Mapping) and "model_type" in data:
        return Workload(model=model_from_hf_config(data, _hf_name(data, path), context=f"transformers config {shown}"))
    return _workload_from_sections(data, f"model file {shown}")


def load_workload(source: str | Path | Mapping[str, Any] | ModelConfig | Workload) -> Workload:
    """What ``--model`` names: a preset, a YAML/JSON file, a transformers config.json, a mapping, a model."""
    if isinstance(source, Workload):
        return source
    if isinstance(source, ModelConfig):
        return Workload(model=source)
    if isinstance(source, Mapping):
        return _workload_from_sections(source, "model mapping")
    if isinstance(source, str) and source in list_presets():
        return load_preset(source)
    if isinstance(source, str | Path):
        text = str(source)
        if not text.strip():
            raise UnknownPresetError(f"model: empty name; presets: {', '.join(list_presets())}")
        return _load_path(Path(text).expanduser(), text)
    raise ConfigError(
        f"model: expected a preset name, a file path, a mapping or a ModelConfig, got {type(source).__name__}"
    )


# --------------------------------------------------------------------------------------------
# overrides


def _validated(build: Callable[[], Any], context: str) -> Any:
    try:
        return build()
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, context)) from None


def resolve(
    source: str | Path | Mapping[str, Any] | ModelConfig | Workload,
    *,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    attention: AttentionImpl | str | None = None,
    dropout: float | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    """The model and training workload after the CLI's overrides (``--seq-len``, ``--global-batch``,
    attention, dropout); a missing training field names the flag that supplies it."""
    workload = load_workload(source)
    model = workload.model
    model_updates: dict[str, Any] = {}
    if attention is not None:
        model_updates["attention"] = attention
    if dropout is not None:
        model_updates["dropout"] = dropout
    if model_updates:
        model = _validated(
            lambda: Workload.model_validate({"model": {**model.model_dump(), **model_updates}}).model,
            "model options",
        )
    training: dict[str, Any] = workload.training.model_dump() if workload.training is not None else {}
    for key, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size)):
        if value is not None:
            if isinstance(value, bool):
                raise ConfigError(f"training.{key}: expected a positive integer, got {value!r}")
            training[key] = value
    for key, flag in _TRAINING_FLAGS.items():
        if training.get(key) is None:
            raise ConfigError(f"training.{key}: missing; pass {flag} N or add it to the training section")
    train = _validated(
        lambda: Workload.model_validate({"model": model, "training": training}).training, "training options"
    )
    if model.positions is PositionKind.LEARNED and train.seq_len > model.max_seq_len:
        raise ConfigError(
            f"training.seq_len: {train.seq_len} exceeds model.max_seq_len {model.max_seq_len} of {model.name}, "
            f"whose learned position table has {model.max_seq_len} rows; use --seq-len {model.max_seq_len} or less"
        )
    return model, train


__all__ = ["Workload", "list_presets", "load_preset", "load_workload", "model_from_hf_config", "resolve"]
