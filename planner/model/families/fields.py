"""What every family's ``config.json`` reader is made of: typed reads of one value (a missing or
null key takes the given default, transformers' own for the model type; a wrong one is a
``ConfigError`` naming the key), the sizes every model type has (``Shape``), the reader of a
family's model types (``FamilyReader``) and what a family registers (``FamilySpec``: its readers,
its model-file defaults and sections; ``planner.model.families.registry`` collects them).

Shared by every family's ``reader`` so none imports another's internals for them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from planner.errors import ConfigError
from planner.model.kinds import Family
from planner.model.limits import CONFIG_JSON_SIZE_KEYS, size_problem


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


class Shape(NamedTuple):
    """The sizes every model type has, with the file keys its head counts came from (for messages)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    heads_key: str
    kv_key: str


@dataclass(frozen=True)
class FamilyReader:
    """One family's reader of the ``config.json`` of its model types.

    ``defaults``: each model type's transformers class defaults for the keys a file may omit (tests
    check them against the installed transformers); ``shape`` reads the sizes, ``fields`` the rest
    of the ModelConfig fields (``fields(data, model_type, defaults, shape, context)``); ``keys``
    names ModelConfig fields by the file's keys in messages (``rms_norm_eps``, not ``norm_eps``)."""

    defaults: Mapping[str, Mapping[str, Any]]
    shape: Callable[[Mapping[str, Any], Mapping[str, Any], str], Shape]
    fields: Callable[[Mapping[str, Any], str, Mapping[str, Any], Shape, str], dict[str, Any]]
    keys: Mapping[str, str]

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.defaults)


@dataclass(frozen=True)
class FamilySpec:
    """What a family package registers (its ``reader.FAMILY``): the readers of its model types;
    the defaults a model file of each of its families leaves out (its published architecture);
    the sections (``moe``, ``mla``) a model file of each must have."""

    readers: tuple[FamilyReader, ...]
    defaults: Mapping[Family, Mapping[str, Any]]
    sections: Mapping[Family, tuple[str, ...]]
