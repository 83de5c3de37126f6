"""DeepSeek-V3's transformers config (model_type deepseek_v3): what it adds to a Llama-like
``config.json``, read into ``ModelConfig`` fields (``mla``, ``moe``, the attention biases).

Mapped from transformers 5.24.0's ``configuration_deepseek_v3.py`` and ``modeling_deepseek_v3.py``:

- attention is ``DeepseekV3Attention`` (multi-head latent attention): ``q_lora_rank`` (null: a
  plain ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``;
  ``attention_bias`` sets q_a_proj's, kv_a_proj_with_mqa's and o_proj's biases (q_proj, q_b_proj and
  kv_b_proj have none). Keys and values are expanded to every head, so ``num_key_value_heads``
  must equal the heads where given (transformers' default, 128, is taken only when it does).
- blocks ``first_k_dense_replace`` and later are MoE blocks (``DeepseekV3MoE``): the router
  ``DeepseekV3TopkRouter`` (fp32 sigmoid scores, the ``e_score_correction_bias`` buffer, the
  ``topk_group`` best of ``n_group`` groups, ``norm_topk_prob``, ``routed_scaling_factor``), E =
  ``n_routed_experts`` (alias ``num_local_experts``) experts of ``moe_intermediate_size``, and
  ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts x moe_intermediate_size``;
  the first blocks keep a dense MLP of ``intermediate_size``. The model's forward adds no
  load-balancing loss (``output_router_logits`` only returns the logits).
- ignored, as transformers' model ignores them for training cost: ``num_nextn_predict_layers``
  (``num_mtp_layers``: the multi-token-prediction layers are not built; their weights are skipped
  at load), ``rope_interleave`` (a weight layout), ``scoring_func``/``topk_method`` (the V3 router
  is always sigmoid/noaux_tc), ``quantization_config`` (the published fp8 weights: a plan trains in
  its own precision), yarn rope scaling (it changes the frequencies and the softmax scale, not
  the cost). Other rope types are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ConfigError
from planner.model.families.deepseek.config import FILE_DEFAULTS, SECTIONS
from planner.model.families.dense.reader import GATED_KEYS, gated_fields, gated_shape
from planner.model.families.fields import FamilyReader, FamilySpec, Shape, hf_bool, hf_float, hf_int, refuse_rope_types
from planner.model.kinds import QkNorm

# transformers' DeepseekV3Config defaults (configuration_deepseek_v3.py) for the keys this reader
# takes; tests check them against the installed transformers
DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_dropout": 0.0, "attention_bias": False, "num_key_value_heads": None,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
}
_ROPE_TYPES = (None, "default", "yarn")


def deepseek_fields(data: Mapping[str, Any], *, n_heads: int, context: str) -> dict[str, Any]:
    """The ModelConfig fields of a deepseek_v3 config.json beyond the Llama-like ones; a
    ConfigError naming the key for what the planner cannot express."""
    d = DEEPSEEK_DEFAULTS
    _refuse_unmodelled(data, n_heads, context)

    def count(key: str, zero_ok: bool = False) -> int:
        if zero_ok and data.get(key) == 0:
            return 0
        return hf_int(data, key, context, default=d[key])

    mla: dict[str, Any] = {key: count(key) for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")}
    if "v_head_dim" in data and data["v_head_dim"] is None:
        raise ConfigError(f"{context}: v_head_dim: null leaves kv_b_proj without a size in DeepseekV3Attention; "
                          "give the value head dim")
    mla["v_head_dim"] = count("v_head_dim")
    mla["q_lora_rank"] = None if "q_lora_rank" in data and data["q_lora_rank"] is None else count("q_lora_rank")
    expert_key = "n_routed_experts" if data.get("n_routed_experts") is not None else "num_local_experts"
    n_experts = hf_int(data, expert_key, context, default=d["n_routed_experts"])
    top_k = count("num_experts_per_tok")
    if top_k > n_experts:
        raise ConfigError(f"{context}: num_experts_per_tok: {top_k} exceeds {expert_key} = {n_experts}; a token is "
                          "routed to at most every expert")
    n_group, topk_group = count("n_group"), count("topk_group")
    if n_experts % n_group or n_experts // n_group < 2:
        raise ConfigError(f"{context}: n_group: {n_group} groups of {n_experts} experts; DeepseekV3TopkRouter scores a "
                          "group by its two best experts, so n_group must divide the experts into groups of 2 or more")
    if topk_group > n_group or top_k > topk_group * (n_experts // n_group):
        raise ConfigError(f"{context}: topk_group: {topk_group} of {n_group} groups hold fewer than "
                          f"num_experts_per_tok = {top_k} experts; raise topk_group")
    expert_size = count("moe_intermediate_size")
    moe = {
        "n_experts": n_experts, "top_k": top_k, "d_ff_expert": expert_size,
        "shared_d_ff": count("n_shared_experts", zero_ok=True) * expert_size,
        "first_dense_layers": count("first_k_dense_replace", zero_ok=True),
        "norm_topk_prob": hf_bool(data, "norm_topk_prob", context, d["norm_topk_prob"]),
        "scoring": "sigmoid", "score_correction_bias": True, "n_group": n_group, "topk_group": topk_group,
        "routed_scaling_factor": hf_float(data, "routed_scaling_factor", context, d["routed_scaling_factor"]),
    }
    bias = hf_bool(data, "attention_bias", context, d["attention_bias"])
    return {"mla": mla, "moe": moe, "qkv_bias": bias, "attn_out_bias": bias, "mlp_bias": False,
            "qk_norm": QkNorm.NONE}


def _refuse_unmodelled(data: Mapping[str, Any], n_heads: int, context: str) -> None:
    """One line naming the key, for what transformers would run but the planner cannot price."""
    kv = data.get("num_key_value_heads")
    if kv is not None and kv != n_heads:
        raise ConfigError(f"{context}: num_key_value_heads: {kv!r}; DeepseekV3Attention expands keys and values to "
                          f"all {n_heads} heads (fewer KV heads would not run); set it to num_attention_heads")
    refuse_rope_types(data, context, _ROPE_TYPES, "(the planner prices plain and yarn RoPE)",
                      "remove {key} or use rope_type default or yarn")


def _fields(
    data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], shape: Shape, context: str
) -> dict[str, Any]:
    """deepseek_v3's ModelConfig fields: the Llama-like ones, then its own."""
    fields = gated_fields(data, model_type, defaults, context)
    fields.update(deepseek_fields(data, n_heads=shape.n_heads, context=context))
    return fields


READER = FamilyReader(defaults={"deepseek_v3": DEEPSEEK_DEFAULTS}, shape=gated_shape, fields=_fields, keys=GATED_KEYS)

# the family's registration (planner.model.families.registry)
FAMILY = FamilySpec(readers=(READER,), defaults=FILE_DEFAULTS, sections=SECTIONS)
