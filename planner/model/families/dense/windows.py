"""Sliding-window attention of the transformers configs (model_type mistral, qwen2, qwen3; mixtral,
olmoe, qwen2_moe, qwen3_moe), read into ``ModelConfig``'s ``sliding_window`` and ``layer_types``.

Mapped from transformers 5.24.0:

- mistral (``configuration_mistral.py``, ``modeling_mistral.py``): ``sliding_window`` (class
  default 4096 when the key is absent; null: none) windows every layer: ``MistralAttention``
  passes ``config.sliding_window`` to the attention function and ``MistralModel`` builds
  ``create_sliding_window_causal_mask`` whenever it is set. ``layer_types`` is not read by
  Mistral's model (``MistralConfig`` only warns about it).
- qwen2, qwen3 (``configuration_qwen2.py``/``configuration_qwen3.py``, ``modeling_*.py``):
  the window is ``sliding_window`` (default 4096) only when ``use_sliding_window`` (default
  false), else none; layer i slides iff ``layer_types[i]`` is sliding_attention, and
  ``layer_types`` defaults to sliding_attention for i >= ``max_window_layers`` (default 28)
  when there is a window. Sliding layers without a window make transformers raise in
  ``create_sliding_window_causal_mask``: refused.

The mixture-of-experts readers (``planner.model.families.moe.reader``) read theirs here too:

- mixtral (``modeling_mixtral.py``): Mistral's rule, but ``MixtralConfig.sliding_window``
  defaults to None (absent: no window).
- olmoe (``modeling_olmoe.py``): ``OlmoeConfig`` has no window field, but a ``sliding_window``
  key in the file becomes a config attribute that ``OlmoeAttention`` hands to the attention
  kernel on every layer (``OlmoeModel`` builds a plain causal mask, so only a kernel that reads
  the argument, FlashAttention-2's ``window_size``, windows); read as Mistral's rule, default None.
- qwen2_moe (``configuration_qwen2_moe.py``): the window is ``sliding_window`` only when
  ``use_sliding_window``; ``layer_types`` defaults to sliding_attention for the even layers
  i < ``max_window_layers`` (default 28) when ``use_sliding_window``.
- qwen3_moe (``configuration_qwen3_moe.py``, ``modeling_qwen3_moe.py``): the window is
  ``sliding_window`` only when ``use_sliding_window``, and then windows every layer
  (``Qwen3MoeModel`` builds one sliding mask for all; ``layer_types`` is not read).

The window changes cost only once the training sequence is longer than it (query i sees keys
i - W < j <= i): ``ModelConfig.window_refusal`` decides that against the seq_len; the eager
attention op prices a binding window as the reference model runs it (``planner.ops.attention``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError
from planner.model.families.fields import hf_bool, hf_int
from planner.model.kinds import LayerType

# transformers 5.24.0's class defaults of the window keys (MistralConfig; Qwen2Config and Qwen3Config;
# MixtralConfig, OlmoeConfig (no field: None), Qwen2MoeConfig, Qwen3MoeConfig)
WINDOW_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28},
    "qwen3": {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28},
    "mixtral": {"sliding_window": None},
    "olmoe": {"sliding_window": None},
    "qwen2_moe": {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28},
    "qwen3_moe": {"sliding_window": 4096, "use_sliding_window": False},
}
# the types whose window (when set) covers every layer: no use_sliding_window switch; with one
_EVERY_LAYER = frozenset({"mistral", "mixtral", "olmoe"})
_SWITCHED_EVERY_LAYER = frozenset({"qwen3_moe"})


def window_fields(data: Mapping[str, Any], model_type: str, n_layers: int, context: str) -> dict[str, Any]:
    """``sliding_window`` (and ``layer_types`` where not every layer slides) of a dense config.json;
    empty when no layer has a window."""
    defaults = WINDOW_DEFAULTS.get(model_type)
    if defaults is None:
        return {}
    window = _window(data, defaults, context)
    if model_type in _EVERY_LAYER:
        return {} if window is None else {"sliding_window": window}
    if not hf_bool(data, "use_sliding_window", context, defaults["use_sliding_window"]):
        window = None
    if model_type in _SWITCHED_EVERY_LAYER:
        return {} if window is None else {"sliding_window": window}
    types = _layer_types(data, n_layers, window, defaults, context, even_below=model_type == "qwen2_moe")
    if LayerType.SLIDING not in types:
        return {}
    if window is None:
        raise ConfigError(f"{context}: layer_types: sliding_attention layers need a window, but use_sliding_window is "
                          "false or sliding_window null (transformers' create_sliding_window_causal_mask raises); set "
                          "use_sliding_window: true with a sliding_window, or list full_attention only")
    if all(t is LayerType.SLIDING for t in types):
        return {"sliding_window": window}
    return {"sliding_window": window, "layer_types": types}


def _window(data: Mapping[str, Any], defaults: Mapping[str, Any], context: str) -> int | None:
    """``sliding_window``: absent takes the class default, null means no window."""
    if data.get("sliding_window") is None and ("sliding_window" in data or defaults["sliding_window"] is None):
        return None
    return hf_int(data, "sliding_window", context, default=defaults["sliding_window"])


def _layer_types(data: Mapping[str, Any], n_layers: int, window: int | None, defaults: Mapping[str, Any],
                 context: str, *, even_below: bool = False) -> tuple[LayerType, ...]:
    """``layer_types``, or the Qwen configs' default when there is a window: sliding from
    ``max_window_layers`` on (Qwen2/Qwen3), or ``even_below``: the even layers below it (Qwen2-MoE)."""
    raw = data.get("layer_types")
    if raw is None:
        first = data.get("max_window_layers")
        first = defaults["max_window_layers"] if first is None else first
        if isinstance(first, bool) or not isinstance(first, int):
            raise ConfigError(f"{context}: max_window_layers: expected an integer, got {first!r}")
        if even_below:
            return tuple(LayerType.SLIDING if window is not None and i % 2 == 0 and i < first else LayerType.FULL
                         for i in range(n_layers))
        return tuple(LayerType.SLIDING if window is not None and i >= first else LayerType.FULL
                     for i in range(n_layers))
    return listed_layer_types(raw, n_layers, context)


def listed_layer_types(raw: Any, n_layers: int, context: str) -> tuple[LayerType, ...]:
    """A config.json's ``layer_types`` list, checked: one known type per layer."""
    allowed = {t.value for t in LayerType}
    if not isinstance(raw, list) or any(t not in allowed for t in raw):
        raise ConfigError(f"{context}: layer_types: expected a list of {' or '.join(sorted(allowed))}, got {raw!r}")
    if len(raw) != n_layers:
        raise ConfigError(f"{context}: layer_types: {len(raw)} entries for num_hidden_layers {n_layers}; list one per "
                          "layer")
    return tuple(LayerType(t) for t in raw)
