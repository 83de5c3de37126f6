"""Typed reads of one transformers ``config.json`` value: a missing or null key takes the given
default (transformers' own, for the model type), a wrong one is a ``ConfigError`` naming the key.

Shared by ``planner.model.readers.dense`` (dense model types) and ``planner.model.readers.moe`` (mixture-of-
experts ones) so neither imports the other's internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError
from planner.model.checks import CONFIG_JSON_SIZE_KEYS, size_problem


def hf_int(data: Mapping[str, Any], key: str, context: str, default: int | None = None) -> int:
    """A positive integer; missing or null: ``default``, or an error where there is none."""
    value = data.get(key)
    if value is None:
        if default is not None:
            return default
        raise ConfigError(f"{context}: {key}: required field is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{context}: {key}: expected a positive integer, got {value!r}")
    beyond = size_problem(CONFIG_JSON_SIZE_KEYS.get(key, ""), value, key)  # before any per-layer list is built
    if beyond is not None:
        raise ConfigError(f"{context}: {beyond}")
    return value


def hf_float(data: Mapping[str, Any], key: str, context: str, default: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{context}: {key}: expected a number, got {value!r}")
    return float(value)


def hf_bool(data: Mapping[str, Any], key: str, context: str, default: bool) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{context}: {key}: expected true or false, got {value!r}")
    return value


def hf_rope_theta(data: Mapping[str, Any], context: str, default: float) -> float:
    """Top-level ``rope_theta`` (transformers 4 files), else inside ``rope_parameters`` (transformers
    5 nests it there) or ``rope_scaling``."""
    if data.get("rope_theta") is not None:
        return hf_float(data, "rope_theta", context, default)
    for key in ("rope_parameters", "rope_scaling"):
        nested = data.get(key)
        if isinstance(nested, Mapping) and nested.get("rope_theta") is not None:
            return hf_float(nested, "rope_theta", f"{context}: {key}", default)
    return default


def refuse_rope_types(data: Mapping[str, Any], context: str, allowed: tuple[str | None, ...], priced: str,
                      fix: str) -> None:
    """One line naming ``rope_parameters`` / ``rope_scaling`` when its rope type is not one of
    ``allowed`` (``priced`` says what the planner prices, ``fix`` what to do; ``{key}`` in it
    names the key)."""
    for key in ("rope_parameters", "rope_scaling"):
        nested = data.get(key)
        if nested is None:
            continue
        if not isinstance(nested, Mapping):
            raise ConfigError(f"{context}: {key}: expected a mapping, got {nested!r}")
        kind = nested.get("rope_type", nested.get("type"))
        if kind not in allowed:
            raise ConfigError(f"{context}: {key}: rope type {kind!r} is not modelled {priced}; {fix.format(key=key)}")
