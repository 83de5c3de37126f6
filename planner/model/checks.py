"""Checks of a model file's sizes and settings, each problem a line naming the field and the fix
(``ModelConfig`` runs them; ``planner.model.sources`` reports them for a whole file at once)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, NamedTuple

from planner.model.kinds import (
    FAMILY_DEFAULTS,
    HF_FAMILIES,
    MOE_FAMILIES,
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


class SizeLimit(NamedTuple):
    """The most a size may be: far beyond any real model or run (so no real input meets it), low
    enough that planning at the limit stays quick. ``what`` completes "more than ...", ``why`` gives the
    published figures the limit leaves room above."""

    most: int
    what: str
    why: str


_DEPTH = SizeLimit(1024, "any model has", "the deepest published ones have 96-160 blocks: GPT-3 96, Llama 3 405B 126")
_WIDTH = SizeLimit(2**17, "any model has", "the widest published ones are 12288-25600: GPT-3, Megatron 1T")
_INNER = SizeLimit(2**20, "any model has", "the widest published MLPs are 53248-102400: Llama 3 405B, Megatron 1T")
_HEADS = SizeLimit(4096, "any model has", "published models have at most 128-160 heads")
_HEAD_DIM = SizeLimit(4096, "any model has", "published heads are 64-256 wide")
_CONTEXT = SizeLimit(2**26, "any model or run has", "the longest published contexts are about 10M tokens: Llama 4 Scout")
_EXPERTS = SizeLimit(16384, "any model has", "published MoE blocks have at most 384 experts: Kimi K2; Switch-C 2048")
_GPUS = SizeLimit(2**20, "any cluster has", "the largest published training clusters have 100k-200k GPUs")

# The one table of size limits: every integer of a model file, its training section and the
# plan's flags that sizes work. ModelConfig and TrainConfig check their fields against it, the
# config.json readers check each key before they expand per-layer lists, and the CLI checks its
# flags, so every source meets the same limit and message.
SIZE_LIMITS: dict[str, SizeLimit] = {
    "n_layers": _DEPTH, "d_model": _WIDTH, "n_heads": _HEADS, "n_kv_heads": _HEADS, "attention_head_dim": _HEAD_DIM,
    "d_ff": _INNER,
    "vocab_size": SizeLimit(2**22, "any model has", "the largest published vocabularies are about 256k: Gemma, PaLM"),
    "max_seq_len": _CONTEXT, "sliding_window": _CONTEXT,
    "loss_chunks": SizeLimit(1024, "any run uses", "torchtitan's chunked loss uses 8"),
    "moe.n_experts": _EXPERTS, "moe.top_k": _EXPERTS, "moe.n_group": _EXPERTS, "moe.topk_group": _EXPERTS,
    "moe.d_ff_expert": _INNER, "moe.shared_d_ff": _INNER, "moe.first_dense_layers": _DEPTH, "moe.every": _DEPTH,
    "mla.q_lora_rank": _WIDTH, "mla.kv_lora_rank": _WIDTH, "mla.qk_nope_head_dim": _HEAD_DIM,
    "mla.qk_rope_head_dim": _HEAD_DIM, "mla.v_head_dim": _HEAD_DIM,
    "seq_len": _CONTEXT,
    "global_batch_size": SizeLimit(2**24, "any run uses", "published runs take at most tens of thousands of sequences "
                                          "per step: BERT with LAMB 65536"),
    "seq_len x global_batch_size": SizeLimit(2**32, "any run uses", "published runs take at most about 60M tokens per step: "
                                        "DeepSeek-V3"),
    "gpus": _GPUS, "tp": _GPUS, "cp": _GPUS, "ep": _GPUS,
    "gpus_per_node": SizeLimit(4096, "any node has", "the largest NVLink domains have 72-576 GPUs: GB200 NVL72, "
                                     "NVL576"),
    "trials": SizeLimit(100_000, "a search needs", "it settles within a few hundred trials"),
    "steps": SizeLimit(10_000, "a validation needs", "a few timed steps settle the mean"),
}
SIZE_LIMITS["micro_batch_size"] = SIZE_LIMITS["global_batch_size"]

# transformers config.json keys and the fields of SIZE_LIMITS they fill: the readers check each
# key's value against the same limit, naming the key, before they build per-layer lists of it.
CONFIG_JSON_SIZE_KEYS: dict[str, str] = {
    "n_layer": "n_layers", "num_hidden_layers": "n_layers", "n_embd": "d_model", "hidden_size": "d_model",
    "n_head": "n_heads", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
    "head_dim": "attention_head_dim", "n_inner": "d_ff", "intermediate_size": "d_ff", "vocab_size": "vocab_size",
    "n_positions": "max_seq_len", "max_position_embeddings": "max_seq_len", "sliding_window": "sliding_window",
    "num_local_experts": "moe.n_experts", "num_experts": "moe.n_experts", "n_routed_experts": "moe.n_experts",
    "num_experts_per_tok": "moe.top_k", "moe_intermediate_size": "moe.d_ff_expert",
    "shared_expert_intermediate_size": "moe.shared_d_ff", "decoder_sparse_step": "moe.every",
    "first_k_dense_replace": "moe.first_dense_layers", "n_group": "moe.n_group", "topk_group": "moe.topk_group",
    "q_lora_rank": "mla.q_lora_rank", "kv_lora_rank": "mla.kv_lora_rank", "qk_nope_head_dim": "mla.qk_nope_head_dim",
    "qk_rope_head_dim": "mla.qk_rope_head_dim", "v_head_dim": "mla.v_head_dim",
}


_GPT2_KEYS = {"n_layers": "n_layer", "d_model": "n_embd", "n_heads": "n_head", "n_kv_heads": "n_head",
              "d_ff": "n_inner", "max_seq_len": "n_positions", "norm_eps": "layer_norm_epsilon",
              "dropout": "resid_pdrop", "tie_embeddings": "tie_word_embeddings", "activation": "activation_function"}
_GATED_KEYS = {"n_layers": "num_hidden_layers", "d_model": "hidden_size", "n_heads": "num_attention_heads",
               "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size", "max_seq_len": "max_position_embeddings",
               "norm_eps": "rms_norm_eps", "dropout": "attention_dropout", "tie_embeddings": "tie_word_embeddings",
               "attention_head_dim": "head_dim", "activation": "hidden_act"}


def config_json_keys(model_type: str) -> dict[str, str]:
    """ModelConfig fields -> the transformers config.json keys the readers fill them from, for
    messages about a config.json (``rms_norm_eps``, not ``norm_eps``)."""
    return _GPT2_KEYS if model_type == "gpt2" else _GATED_KEYS


def _shown(value: int) -> str:
    return str(value) if abs(value) < 10**15 else f"{value:.3g}"


def size_problem(field: str, value: Any, shown: str | None = None) -> str | None:
    """``field: value is more than ... (at most N)`` when an integer ``value`` is beyond the field's
    ``SIZE_LIMITS`` entry, else None; ``shown`` names the field as the user wrote it (a config.json
    key, a flag)."""
    limit = SIZE_LIMITS.get(field)
    if limit is None or isinstance(value, bool) or not isinstance(value, int) or value <= limit.most:
        return None
    return f"{shown or field}: {_shown(value)} is more than {limit.what} (at most {limit.most:,}; {limit.why})"


def size_problems(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every size of a model or training section (sub-sections ``moe``/``mla`` included) beyond
    its limit, one line each."""
    problems = []
    for key, value in values.items():
        if isinstance(value, Mapping) and not prefix:
            problems.extend(size_problems(value, f"{key}."))
        problem = size_problem(f"{prefix}{key}", value)
        if problem is not None:
            problems.append(problem)
    return problems


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
    if family in (Family.DEEPSEEK_V3, Family.DEEPSEEK_V3.value) and mla is None:
        problems.append("mla: family deepseek_v3 has multi-head latent attention; add an mla section (kv_lora_rank, "
                        "qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank")
    if family in MOE_FAMILIES and moe is None:
        problems.append(f"moe: family {family} has mixture-of-experts MLPs; add a moe section (n_experts, top_k, "
                        "d_ff_expert")
    problems.extend(implementation_problems(values))
    return problems


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
