"""The Phi-3 transformers config (model_type phi3), read into ``ModelConfig`` fields.

Mapped from transformers 5.24.0's ``models/phi3/configuration_phi3.py`` (``Phi3Config``) and
``models/phi3/modeling_phi3.py``:

- ``Phi3Attention``: one ``qkv_proj`` (D -> (N + 2K) H, no bias) whose output is sliced into q,
  k and v (views of that one tensor: whatever keeps one of them alive keeps all of it),
  ``o_proj`` without bias; H = ``head_dim`` where the file sets it, else D / N.
- ``Phi3MLP``: one ``gate_up_proj`` (D -> 2F, no bias), its output chunked into gate and up
  (views), ``up * act(gate)``, ``down_proj``; ``hidden_act`` silu gives SwiGLU.
- RoPE (``Phi3RotaryEmbedding``, ``apply_rotary_pos_emb``): the first int(H x
  ``partial_rotary_factor``) dims of each head are rotated, the rest passed through and
  concatenated back. The factor is read from ``rope_parameters``/``rope_scaling`` or the top level
  (``Phi3Config.convert_rope_params_to_dict``; default 1.0). Rope types default and longrope
  (``su`` and ``yarn`` are renamed longrope there): longrope changes only the values of cos and sin
  (short/long factors on the frequencies, ``attention_factor`` on both), so the planner prices the
  same (T, rotated dims) tables as plain RoPE: the cos/sin cost only.
- ``sliding_window`` (default null): when set, ``Phi3Model`` masks every layer with
  ``create_sliding_window_causal_mask`` (query i sees keys i - W < j <= i), as Mistral does; the
  planner's window handling then applies (``ModelConfig.window_refusal``: flash only while the
  window masks nothing, eager past it). Phi-3-mini-4k sets 2047.
- Dropouts: ``resid_pdrop`` on each branch's output, ``attention_dropout`` in the core and no
  embedding dropout (``embd_pdrop`` is read by nothing); the planner's one ``dropout`` covers the
  embedding too, so any of them above 0 is refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError
from planner.model.families.dense.reader import GATED_KEYS, gated_fields, gated_shape
from planner.model.families.fields import FamilyReader, FamilySpec, Shape, hf_float, hf_int, refuse_rope_types
from planner.model.families.phi3.config import FILE_DEFAULTS, SECTIONS

# Phi3Config's defaults (transformers 5.24.0) for the keys a config.json may omit; tests check them
# against the installed transformers
PHI3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "rope_theta": 10000.0,
    "partial_rotary_factor": 1.0,
}
_ROPE_TYPES = (None, "default", "longrope", "su", "yarn")
_DROPOUTS = ("attention_dropout", "resid_pdrop", "embd_pdrop")


def _partial_rotary_factor(data: Mapping[str, Any], context: str) -> float:
    """``partial_rotary_factor`` of ``rope_parameters`` (or legacy ``rope_scaling``, which replaces
    it), else the top-level key, else 1.0; in (0, 1]."""
    key, where = "partial_rotary_factor", data
    for nested_key in ("rope_scaling", "rope_parameters"):
        nested = data.get(nested_key)
        if isinstance(nested, Mapping) and nested:  # a non-empty rope_scaling replaces rope_parameters
            if nested.get(key) is not None:
                key, where = f"{nested_key}: {key}", nested
            break
    factor = hf_float(where, "partial_rotary_factor", context, PHI3_DEFAULTS["partial_rotary_factor"])
    if not 0 < factor <= 1:
        raise ConfigError(f"{context}: {key}: expected a number in (0, 1], got {factor!r}")
    return factor


def _fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """phi3's ModelConfig fields: the Llama-like ones, fused projections, the rotated share of each
    head, the window of every layer, the head dim; dropouts refused above 0."""
    refuse_rope_types(data, context, _ROPE_TYPES, "for phi3 (default and longrope cost plain RoPE tables)",
                      "use rope_type default or longrope")
    for key in _DROPOUTS:
        if hf_float(data, key, context, defaults[key]):
            raise ConfigError(f"{context}: {key}: Phi-3's dropouts are not priced (resid_pdrop on the branches, "
                              "attention_dropout in the core, no embedding dropout); set attention_dropout, "
                              "resid_pdrop and embd_pdrop to 0")
    fields = gated_fields(data, model_type, defaults, context)
    fields["fused_projections"] = True
    factor = _partial_rotary_factor(data, context)
    if factor != 1.0:
        fields["partial_rotary_factor"] = factor
    if data.get("sliding_window") is not None:
        fields["sliding_window"] = hf_int(data, "sliding_window", context)
    if data.get("head_dim") is not None:  # Phi3Attention: getattr(config, "head_dim", D / N)
        head_dim = hf_int(data, "head_dim", context)
        if head_dim * shape.n_heads != shape.d_model:
            fields["attention_head_dim"] = head_dim
    return fields


READER = FamilyReader(defaults={"phi3": PHI3_DEFAULTS}, shape=gated_shape, fields=_fields, keys=GATED_KEYS)

# the family's registration (planner.model.families.registry)
FAMILY = FamilySpec(readers=(READER,), defaults=FILE_DEFAULTS, sections=SECTIONS)
