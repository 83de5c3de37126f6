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

import warnings
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from hardware.files import parse_text, read_text_file
from hardware.validation import describe_validation_error
from planner.errors import ConfigError, ConfigWarning, UnknownPresetError
from planner.model.checks import shape_problems, with_family_defaults
from planner.model.config import (
    AttentionImpl,
    Implementation,
    LossKind,
    ModelConfig,
    PositionKind,
    TrainConfig,
    effective_loss,
    effective_loss_chunks,
)
from planner.model.families.config_json import hf_name, model_from_hf_config

_PRESET_DIR = "presets"
_SECTIONS = ("model", "training", "finetune")  # finetune: planner.finetune.config, read into the model

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
    return Path(str(resources.files("planner.model").joinpath(_PRESET_DIR)))


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
# files and mappings


def _parse_file(path: Path, context: str) -> Any:
    """Parsed YAML (or JSON for ``.json``); malformed input names the line."""
    text = read_text_file(path, context, "a YAML/JSON model file or a transformers config.json")
    return parse_text(text, context, as_json=path.suffix.lower() == ".json")


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
        return Workload(model=model_from_hf_config(data, hf_name(data, None), context=context))
    unknown = [key for key in data if key not in _SECTIONS]
    if unknown:
        raise ConfigError(
            f"{context}: {unknown[0]}: unknown top-level key; a model file has only model:, training: and finetune: sections "
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
    if data.get("finetune") is not None:  # adapters trained on the frozen model (planner.finetune)
        model = {**model, "finetune": data["finetune"]}
    try:
        return Workload.model_validate({"model": model, "training": training})
    except ValidationError as error:
        message = describe_validation_error(error, context)
        # the checks between fields do not run while a field fails: name them in the same message
        extra = [f"model: {p}" for p in shape_problems(with_family_defaults(model)) if p not in message]
        raise ConfigError("; ".join([message, *extra])) from None


def _load_path(path: Path, shown: str) -> Workload:
    if not path.exists():
        raise UnknownPresetError(
            f"model: {shown}: no such file and not a preset; presets: {', '.join(list_presets())} "
            "(or give a path to a YAML/JSON model file or a transformers config.json)"
        )
    data = _parse_file(path, f"model file {shown}")
    if isinstance(data, Mapping) and "model_type" in data:
        return Workload(model=model_from_hf_config(data, hf_name(data, path), context=f"transformers config {shown}"))
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
    implementation: Implementation | str | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    """The model and training workload after the CLI's overrides (``--seq-len``, ``--global-batch``,
    attention, dropout, implementation); a missing training field names the flag that supplies it."""
    workload = load_workload(source)
    model = workload.model
    model_updates: dict[str, Any] = {}
    if attention is not None:
        model_updates["attention"] = attention
    if dropout is not None:
        model_updates["dropout"] = dropout
    if implementation is not None:
        model_updates["implementation"] = implementation
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
    return _bounded_context(model, train), train


def _bounded_context(model: ModelConfig, train: TrainConfig) -> ModelConfig:
    """``max_seq_len`` against the training ``seq_len``: learned positions cannot go beyond their
    table (error); rotary ones can, but past the trained context quality suffers (one-line
    warning); a rotary model without ``max_seq_len`` takes the training ``seq_len``."""
    limit = model.max_seq_len
    if model.positions is PositionKind.LEARNED and limit is not None and train.seq_len > limit:
        raise ConfigError(
            f"training.seq_len: {train.seq_len} exceeds model.max_seq_len {limit} of {model.name}, "
            f"whose learned position table has {limit} rows; use --seq-len {limit} or less"
        )
    chunks = effective_loss_chunks(model)
    if effective_loss(model) is LossKind.CHUNKED and train.seq_len % chunks:
        raise ConfigError(f"model.loss_chunks: torchtitan's ChunkedLossWrapper splits each sequence into {chunks} "
                          f"equal chunks; {train.seq_len} tokens do not divide; set loss_chunks to a divisor")
    window = model.window_refusal(train.seq_len)
    if window is not None:
        raise ConfigError(f"model {model.name}: {window}")
    if limit is None:
        return model.model_copy(update={"max_seq_len": train.seq_len})
    if train.seq_len > limit:
        warnings.warn(
            f"training.seq_len {train.seq_len} is beyond model.max_seq_len {limit} of {model.name}: rotary "
            "positions run at any length, but the model was built for that context (planned as asked)",
            ConfigWarning, stacklevel=3)
    return model


__all__ = ["Workload", "list_presets", "load_preset", "load_workload", "model_from_hf_config", "resolve"]
