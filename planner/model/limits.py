"""The size limits of every integer a model file, its training section, a transformers
``config.json`` and the plan's flags give, each problem one line naming the field (``ModelConfig``
and ``TrainConfig`` check their fields, the config.json readers each key, the CLI its flags).
Imports nothing of ours, so every reader can use it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


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
