"""DeepSeek-V3 transformers configs (model_type deepseek_v3) read as ModelConfigs: field by field,
the preset against its published config.json, omitted keys against transformers' defaults,
refusals in one line, and exact parameter counts against transformers 5.24.0's
DeepseekV3ForCausalLM built on the meta device (small variants and the real 671B size)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from planner.errors import ConfigError
from planner.graph.params import param_tensors
from planner.model.config import Family
from planner.model.families.config_json import model_from_hf_config
from planner.model.families.deepseek.config import MlaConfig
from planner.model.families.moe.config import MoeConfig
from planner.model.sources import load_preset

# deepseek-ai/DeepSeek-V3 config.json (https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json),
# less its quantization_config (the published fp8 block-wise weights: transformers would quantize the
# model it builds; a training plan ignores it) and auto_map
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
DEEPSEEK_V3_PARAMS = 671_026_404_352  # transformers 5.24.0 on the meta device (test below)

TINY: dict[str, Any] = {
    "model_type": "deepseek_v3", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 100, "moe_intermediate_size": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
}
TINY_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("tiny", TINY),
    ("plain q_proj (V2-Lite shape)", {**TINY, "q_lora_rank": None}),
    ("attention bias", {**TINY, "attention_bias": True}),
    ("no dense block, two shared experts", {**TINY, "first_k_dense_replace": 0, "n_shared_experts": 2}),
    ("all dense", {**TINY, "first_k_dense_replace": 5}),
    ("num_local_experts alias, tied", {**{k: v for k, v in TINY.items() if k != "n_routed_experts"},
                                       "num_local_experts": 4, "n_group": 1, "tie_word_embeddings": True}),
    ("hidden not divisible by heads", {**TINY, "hidden_size": 70}),
]


def test_deepseek_v3() -> None:
    model = model_from_hf_config(DEEPSEEK_V3, "deepseek-v3")
    assert model.family is Family.DEEPSEEK_V3
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.d_ff, model.vocab_size) == (
        61, 7168, 128, 128, 18432, 129280)
    assert (model.max_seq_len, model.norm_eps, model.rope_theta) == (163840, 1e-6, 10000.0)
    assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias or model.tie_embeddings)
    assert model.mla == MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128)
    assert model.moe == MoeConfig(n_experts=256, top_k=8, d_ff_expert=2048, shared_d_ff=2048, first_dense_layers=3,
                                  scoring="sigmoid", score_correction_bias=True, n_group=8, topk_group=4,
                                  routed_scaling_factor=2.5)
    assert [model.moe.is_sparse(b) for b in range(5)] == [False, False, False, True, True]


def test_preset_is_its_published_config() -> None:
    from_json = model_from_hf_config(DEEPSEEK_V3, "deepseek-v3").model_dump(exclude={"activation"})
    assert load_preset("deepseek-v3").model.model_dump(exclude={"activation"}) == from_json


def test_ignored_keys_change_nothing() -> None:
    """What transformers' model does not build or price differently: the MTP layers, the rotary
    layout, the scoring/top-k method names (V3's router is always sigmoid/noaux_tc), yarn."""
    base = model_from_hf_config(TINY)
    for extra in ({"num_nextn_predict_layers": 2}, {"rope_interleave": False}, {"scoring_func": "softmax"},
                  {"topk_method": "greedy"}, {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 64}}):
        assert model_from_hf_config({**TINY, **extra}) == base, extra


REFUSALS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("linear rope", {**TINY, "rope_scaling": {"type": "linear", "factor": 2.0}}, ("rope_scaling", "linear")),
    ("dynamic rope", {**TINY, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     ("rope_parameters", "dynamic")),
    ("fewer kv heads", {**TINY, "num_key_value_heads": 2}, ("num_key_value_heads", "num_attention_heads")),
    ("null v_head_dim", {**TINY, "v_head_dim": None}, ("v_head_dim", "null")),
    ("groups of one expert", {**TINY, "n_group": 8}, ("n_group", "groups of 2")),
    ("groups not dividing", {**TINY, "n_group": 3}, ("n_group",)),
    ("too few groups for top-k", {**TINY, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     ("topk_group", "num_experts_per_tok")),
    ("top-k over experts", {**TINY, "num_experts_per_tok": 9}, ("num_experts_per_tok", "n_routed_experts")),
    ("odd rope dim", {**TINY, "qk_rope_head_dim": 7}, ("qk_rope_head_dim", "even")),
]


@pytest.mark.parametrize(("case", "data", "needles"), REFUSALS, ids=[case for case, _, _ in REFUSALS])
def test_refusals_are_one_line_naming_the_field(case: str, data: dict[str, Any], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config(data)
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("transformers config"), message
    for needle in needles:
        assert needle in message, (needle, message)


# ---------------------------------------------------------------------------------------------
# torch and transformers from here on: defaults and exact parameter counts on the meta device

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_count(data: dict[str, Any]) -> int:
    config = transformers.AutoConfig.for_model(**copy.deepcopy(data))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def planner_count(data: dict[str, Any]) -> int:
    return sum(param_tensors(model_from_hf_config(data)).values())


def test_omitted_keys_take_transformers_defaults() -> None:
    data = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 16,
            "intermediate_size": 96, "vocab_size": 100}
    model = model_from_hf_config(data)
    config = transformers.AutoConfig.for_model(**data)
    assert model.tie_embeddings is bool(config.tie_word_embeddings)
    assert (model.max_seq_len, model.norm_eps, model.dropout) == (
        config.max_position_embeddings, config.rms_norm_eps, config.attention_dropout)
    assert model.rope_theta == config.rope_parameters["rope_theta"]
    assert model.qkv_bias is config.attention_bias and model.attn_out_bias is config.attention_bias
    mla, moe = model.mla, model.moe
    assert mla is not None and moe is not None
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
    assert (moe.n_experts, moe.top_k, moe.d_ff_expert, moe.shared_d_ff // moe.d_ff_expert) == (
        config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.n_shared_experts)
    assert (moe.first_dense_layers, moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.norm_topk_prob) == (
        config.first_k_dense_replace, config.n_group, config.topk_group, config.routed_scaling_factor,
        config.norm_topk_prob)
    assert planner_count(data) == hf_count(data)


@pytest.mark.parametrize(("case", "data"), TINY_VARIANTS, ids=[case for case, _ in TINY_VARIANTS])
def test_tiny_count_equals_transformers(case: str, data: dict[str, Any]) -> None:
    assert planner_count(data) == hf_count(data)


def test_real_size_count_equals_transformers() -> None:
    """671B: the main model transformers builds (the MTP module is not built), the correction
    biases being buffers; the preset's count is the same."""
    assert hf_count(DEEPSEEK_V3) == DEEPSEEK_V3_PARAMS
    assert planner_count(DEEPSEEK_V3) == DEEPSEEK_V3_PARAMS
    assert sum(param_tensors(load_preset("deepseek-v3").model).values()) == DEEPSEEK_V3_PARAMS
