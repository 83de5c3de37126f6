"""Checks of a model file's settings, each problem a line naming the field and the fix
(``ModelConfig`` runs them; ``planner.model.sources`` reports them for a whole file at once); its
sizes are checked against ``planner.model.limits``, its family's defaults and sections come from
``planner.model.families.registry``."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from planner.model.families.registry import FAMILY_DEFAULTS, FAMILY_SECTIONS
from planner.model.kinds import (
    HF_FAMILIES,
    Activation,
    AttentionImpl,
    Family,
    Implementation,
    LayerType,
    LossKind,
    MlpKind,
    PositionKind,
    QkNorm,
)
from planner.model.limits import size_problems


def with_family_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
    """A model section with its family's defaults filled in (an unknown family: unchanged, the
    field validator names it)."""
    try:
        family = Family(str(data.get("family")))
    except ValueError:
        return dict(data)
    merged = dict(data)
    for key, value in FAMILY_DEFAULTS[family].items():
        if merged.get(key) is None:
            merged[key] = value
    if merged.get("n_kv_heads") is None:
        merged["n_kv_heads"] = merged.get("n_heads")
    if merged.get("qk_norm") is None:
        merged["qk_norm"] = QkNorm.NONE
    return merged


def shape_problems(values: Mapping[str, Any]) -> list[str]:
    """Every problem between fields of a model section (family defaults applied) whose values are
    themselves valid: ``ModelConfig`` raises them together, and a file that also has bad fields
    gets them in the same message (pydantic runs no model check while a field fails)."""
    bounded = size_problems(values)
    if bounded:  # the checks below multiply sizes: a size beyond any model's is the one problem to fix
        return bounded

    def size(key: str) -> int | None:
        value = values.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    d, n = size("d_model"), size("n_heads")
    k = size("n_kv_heads") if values.get("n_kv_heads") is not None else n
    positions = values.get("positions")
    problems = []
    explicit = size("attention_head_dim")
    mla = values.get("mla")
    if mla is not None:
        problems.extend(_mla_problems(values, n, k))
        d = None  # MLA's head dims are its own: d_model need not split into heads
    if explicit:
        d = explicit * n if n else None  # the rotary check below reads H = d / n
    if d and n and d % n:
        problems.append(f"d_model ({d}) must be divisible by n_heads ({n}), or set attention_head_dim; change one "
                        "of them")
    if n and k and n % k:
        problems.append(f"n_heads ({n}) must be divisible by n_kv_heads ({k}) for grouped-query attention")
    if positions in (PositionKind.LEARNED, PositionKind.LEARNED.value) and values.get("max_seq_len") is None:
        problems.append("max_seq_len: required with learned positions (the position table has max_seq_len rows); "
                        "add it to the model section")
    if positions in (PositionKind.ROTARY, PositionKind.ROTARY.value) and d and n and not d % n and (d // n) % 2:
        problems.append(f"rotary positions need an even head dim, got d_model/n_heads = {d // n}")
    family = values.get("family")
    moe = values.get("moe")
    problems.extend(attention_problems(values))
    sections = {"mla": mla, "moe": moe}
    required = FAMILY_SECTIONS.get(family, ()) if family is not None else ()  # the sub-configs its blocks need
    for section in required:
        if sections[section] is None:
            problems.append(_MISSING_SECTION[section].format(family=family))
    problems.extend(implementation_problems(values))
    return problems


_MISSING_SECTION = {
    "mla": "mla: family {family} has multi-head latent attention; add an mla section (kv_lora_rank, "
           "qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank",
    "moe": "moe: family {family} has mixture-of-experts MLPs; add a moe section (n_experts, top_k, d_ff_expert",
}


def _mla_problems(values: Mapping[str, Any], n: int | None, k: int | None) -> list[str]:
    """What multi-head latent attention cannot be combined with."""
    problems = []
    if values.get("positions") not in (PositionKind.ROTARY, PositionKind.ROTARY.value):
        problems.append("mla: multi-head latent attention rotates qk_rope_head_dim dims; use positions: rotary")
    if n and k and n != k:
        problems.append(f"n_kv_heads: multi-head latent attention expands keys and values to every head; set n_kv_heads "
                        f"to n_heads ({n}) or drop it")
    if values.get("attention_head_dim") is not None:
        problems.append("attention_head_dim: multi-head latent attention sets its head dims in mla; drop attention_head_dim")
    if values.get("qk_norm") not in (None, QkNorm.NONE, QkNorm.NONE.value):
        problems.append("qk_norm: multi-head latent attention norms its latents, not q and k; set qk_norm: none")
    if values.get("attention") in (AttentionImpl.EAGER, AttentionImpl.EAGER.value):
        problems.append("attention: eager attention with mla is not modelled yet (query/key and value head dims differ); "
                        "use attention: flash")
    return problems


def attention_problems(values: Mapping[str, Any]) -> list[str]:
    """Sliding windows and sinks: layer types that fit the blocks, and the attention that runs them."""
    problems = []
    raw_types = values.get("layer_types")
    types = [str(getattr(t, "value", t)) for t in raw_types] if isinstance(raw_types, list | tuple) else None
    n_layers = values.get("n_layers")
    if types is not None and isinstance(n_layers, int) and len(types) != n_layers:
        problems.append(f"layer_types: {len(types)} entries for n_layers {n_layers}; list one per block")
    if types is not None and LayerType.SLIDING.value in types and values.get("sliding_window") is None:
        problems.append("sliding_window: layer_types lists sliding_attention blocks but no window is set; set "
                        "sliding_window (or list full_attention only")
    flash = str(getattr(values.get("attention"), "value", values.get("attention"))) == AttentionImpl.FLASH.value
    # flash with a window is checked against the training seq_len (ModelConfig.window_refusal): a
    # window of at least T tokens masks nothing, so SDPA's is_causal is then exact
    if values.get("attention_sinks") and flash:
        problems.append("attention_sinks: PyTorch's SDPA has no sink logit; set attention: eager (transformers runs "
                        "gpt-oss eagerly: its _supports_sdpa is False")
    return problems


_GELUS = frozenset({Activation.GELU_PYTORCH_TANH, Activation.GELU, Activation.GELU_NEW, Activation.GELU_FAST})


def implementation_problems(values: Mapping[str, Any]) -> list[str]:
    """What an implementation cannot run, and activations or losses that do not fit the model."""
    def member(enum: type[StrEnum], key: str) -> Any:
        value = values.get(key)
        try:
            return enum(str(value)) if value is not None else None
        except ValueError:
            return None  # the field's own validator names it

    impl, act, loss = member(Implementation, "implementation"), member(Activation, "activation"), member(LossKind, "loss")
    mlp = member(MlpKind, "mlp")
    flash = str(getattr(values.get("attention"), "value", values.get("attention"))) == AttentionImpl.FLASH.value
    sliding = values.get("sliding_window") is not None
    problems = []
    if impl not in (None, Implementation.REFERENCE) and values.get("moe") is not None:
        problems.append(f"implementation: {impl.value}'s mixture-of-experts blocks (grouped_mm experts, sort-based "
                        "dispatch) are not priced yet; use implementation reference")
    if impl not in (None, Implementation.REFERENCE) and values.get("mla") is not None:
        problems.append(f"implementation: {impl.value}'s multi-head latent attention is not priced yet; use "
                        "implementation reference")
    if impl not in (None, Implementation.REFERENCE) and ((sliding and not flash) or values.get("attention_sinks")):
        problems.append(f"implementation: {impl.value}'s sliding-window and sink attention are not priced yet; use "
                        "implementation reference")
    if impl is Implementation.HF and values.get("family") not in HF_FAMILIES:
        problems.append(f"implementation: hf is priced for families {', '.join(sorted(HF_FAMILIES))} (their transformers "
                        f"code), not {values.get('family')}; use implementation reference")
    if impl is Implementation.TORCHTITAN and values.get("family") not in (Family.LLAMA, Family.LLAMA.value):
        problems.append(f"implementation: torchtitan is priced for family llama only (torchtitan 0.3.0's "
                        f"Llama3Model), not {values.get('family')}; use implementation hf or reference")
    if impl is Implementation.TORCHTITAN and (values.get("qkv_bias") or values.get("attn_out_bias")
                                              or values.get("mlp_bias")):
        problems.append("implementation: torchtitan's Llama3Model has no biases; set qkv_bias, attn_out_bias and "
                        "mlp_bias to false or use implementation hf")
    if act is not None and mlp is MlpKind.SWIGLU and act is not Activation.SILU:
        problems.append(f"activation: {act.value} does not gate a SwiGLU MLP; use silu (or mlp: gelu")
    if act is not None and mlp is MlpKind.GELU and act not in _GELUS:
        problems.append(f"activation: {act.value} is not a GELU; use one of {', '.join(sorted(a.value for a in _GELUS))}")
    if values.get("loss_chunks") is not None and loss is not LossKind.CHUNKED and not (
            loss is None and impl is Implementation.TORCHTITAN):
        problems.append("loss_chunks: only the chunked loss has sequence chunks; set loss: chunked or drop loss_chunks")
    return problems
