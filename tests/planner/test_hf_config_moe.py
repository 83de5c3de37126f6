"""Mixture-of-experts transformers configs (mixtral, qwen2_moe, qwen3_moe, olmoe) read as ModelConfigs,
the model types refused with one line, and exact parameter counts against transformers 5.24.0's
models built on the meta device (nothing is allocated, so Mixtral 8x7B builds in about a second).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from planner.errors import ConfigError
from planner.graph.params import param_tensors
from planner.model.config import Family, QkNorm
from planner.model.families.config_json import model_from_hf_config
from planner.model.families.moe.config import MoeConfig
from planner.model.sources import load_preset, load_workload

# ---------------------------------------------------------------------------------------------
# the published config.json files (the keys transformers reads; ids of the Hugging Face repos)

# mistralai/Mixtral-8x7B-v0.1
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}
# Qwen/Qwen1.5-MoE-A2.7B
QWEN1_5_MOE_A2_7B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
# Qwen/Qwen3-30B-A3B
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
# allenai/OLMoE-1B-7B-0924
OLMOE_1B_7B: dict[str, Any] = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
    "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 50304,
}

# preset name -> (published config.json, its total parameters: transformers 5.24.0 on the meta device)
PUBLISHED: dict[str, tuple[dict[str, Any], int]] = {
    "mixtral-8x7b": (MIXTRAL_8X7B, 46_702_792_704),
    "qwen1.5-moe-a2.7b": (QWEN1_5_MOE_A2_7B, 14_315_784_192),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 30_532_122_624),
    "olmoe-1b-7b": (OLMOE_1B_7B, 6_919_161_856),
}

# Small configs of each family, with the cases that change the tensors: explicit head dims,
# biases, dense blocks (decoder_sparse_step, mlp_only_layers), tied embeddings, GQA vs MHA.
_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
TINY_MIXTRAL = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 128,
                "num_local_experts": 4, "num_experts_per_tok": 2, **_NO_TOKENS}
TINY_QWEN2_MOE = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "num_experts": 6, "num_experts_per_tok": 2,
                  "vocab_size": 100, "max_position_embeddings": 128, **_NO_TOKENS}
TINY_QWEN3_MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 128, "moe_intermediate_size": 32,
                  "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 100,
                  "max_position_embeddings": 128, **_NO_TOKENS}
TINY_OLMOE = {"model_type": "olmoe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 100, "max_position_embeddings": 128, **_NO_TOKENS}
TINY_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("mixtral", TINY_MIXTRAL),
    ("mixtral head_dim 32", {**TINY_MIXTRAL, "head_dim": 32}),
    ("mixtral tied, MHA", {**TINY_MIXTRAL, "tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("qwen2_moe", TINY_QWEN2_MOE),
    ("qwen2_moe every 2nd block", {**TINY_QWEN2_MOE, "decoder_sparse_step": 2}),
    ("qwen2_moe first 2 dense", {**TINY_QWEN2_MOE, "mlp_only_layers": [0, 1]}),
    ("qwen2_moe no qkv bias, GQA", {**TINY_QWEN2_MOE, "qkv_bias": False, "num_key_value_heads": 2}),
    ("qwen2_moe head_dim 8", {**TINY_QWEN2_MOE, "head_dim": 8}),
    ("qwen3_moe", TINY_QWEN3_MOE),
    ("qwen3_moe biases, first dense", {**TINY_QWEN3_MOE, "attention_bias": True, "mlp_only_layers": [0]}),
    ("qwen3_moe head_dim = D/N", {**TINY_QWEN3_MOE, "head_dim": 16}),
    ("olmoe", TINY_OLMOE),
    ("olmoe biases, tied", {**TINY_OLMOE, "attention_bias": True, "tie_word_embeddings": True}),
]


def one_line_error(excinfo: pytest.ExceptionInfo[ConfigError], *needles: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# ---------------------------------------------------------------------------------------------
# each reader: the published files map to the presets, field by field


def test_mixtral_8x7b() -> None:
    model = model_from_hf_config(MIXTRAL_8X7B, "mixtral-8x7b")
    assert model.family is Family.MIXTRAL
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.head_dim, model.vocab_size) == (
        32, 4096, 32, 8, 128, 32000)
    assert model.attention_head_dim is None and model.qk_norm is QkNorm.NONE
    assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias or model.tie_embeddings)
    assert (model.max_seq_len, model.norm_eps, model.rope_theta) == (32768, 1e-5, 1e6)
    # output_router_logits false: transformers adds no aux loss, whatever router_aux_loss_coef says
    assert model.moe == MoeConfig(n_experts=8, top_k=2, d_ff_expert=14336, norm_topk_prob=True, aux_loss_coef=0.0)


def test_qwen1_5_moe_a2_7b() -> None:
    model = model_from_hf_config(QWEN1_5_MOE_A2_7B, "qwen1.5-moe-a2.7b")
    assert model.family is Family.QWEN2_MOE
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.d_ff, model.vocab_size) == (
        24, 2048, 16, 16, 5632, 151936)
    assert model.qkv_bias and not model.attn_out_bias and not model.mlp_bias and model.qk_norm is QkNorm.NONE
    assert (model.max_seq_len, model.norm_eps, model.rope_theta) == (8192, 1e-6, 1e6)
    assert model.moe == MoeConfig(n_experts=60, top_k=4, d_ff_expert=1408, shared_d_ff=5632, shared_gate=True,
                                  norm_topk_prob=False)


def test_qwen3_30b_a3b() -> None:
    model = model_from_hf_config(QWEN3_30B_A3B, "qwen3-30b-a3b")
    assert model.family is Family.QWEN3_MOE
    # head_dim 128 is not hidden_size / heads = 64: q projects 2048 -> 32 x 128
    assert (model.n_heads, model.kv_heads, model.attention_head_dim, model.head_dim) == (32, 4, 128, 128)
    assert model.qk_norm is QkNorm.HEAD and not (model.qkv_bias or model.attn_out_bias or model.mlp_bias)
    assert (model.max_seq_len, model.norm_eps, model.rope_theta, model.d_ff) == (40960, 1e-6, 1e6, 6144)
    assert model.moe == MoeConfig(n_experts=128, top_k=8, d_ff_expert=768, norm_topk_prob=True)


def test_olmoe_1b_7b() -> None:
    model = model_from_hf_config(OLMOE_1B_7B, "olmoe-1b-7b")
    assert model.family is Family.OLMOE
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.vocab_size) == (16, 2048, 16, 16, 50304)
    assert model.qk_norm is QkNorm.FULL and not (model.qkv_bias or model.attn_out_bias or model.tie_embeddings)
    assert (model.max_seq_len, model.norm_eps, model.rope_theta) == (4096, 1e-5, 10000.0)
    assert model.moe == MoeConfig(n_experts=64, top_k=8, d_ff_expert=1024, norm_topk_prob=False)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_is_its_published_config(name: str) -> None:
    """The bundled preset and the published config.json describe the same model."""
    from_json = model_from_hf_config(PUBLISHED[name][0], name).model_dump(exclude={"activation"})
    assert load_preset(name).model.model_dump(exclude={"activation"}) == from_json


@pytest.mark.parametrize(("case", "data"), TINY_VARIANTS, ids=[case for case, _ in TINY_VARIANTS])
def test_tiny_variants_map(case: str, data: dict[str, Any]) -> None:
    model = model_from_hf_config(data)
    assert model.moe is not None
    expected_head_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    assert model.head_dim == expected_head_dim
    sparse = [model.moe.is_sparse(i) for i in range(model.n_layers)]
    step, dense = data.get("decoder_sparse_step", 1), data.get("mlp_only_layers", [])
    assert sparse == [i not in dense and (i + 1) % step == 0 for i in range(model.n_layers)]


def experts(data: dict[str, Any]) -> MoeConfig:
    moe = model_from_hf_config(data).moe
    assert moe is not None
    return moe


def test_num_experts_aliases() -> None:
    # transformers' attribute_map: MixtralConfig and Qwen3MoeConfig/OlmoeConfig read either name
    assert experts({**TINY_MIXTRAL, "num_local_experts": None, "num_experts": 6}).n_experts == 6
    assert experts({**TINY_OLMOE, "num_experts": None, "num_local_experts": 6}).n_experts == 6
    # Qwen2MoeConfig has no alias: num_local_experts is ignored, its num_experts default (60) stands
    data = {k: v for k, v in TINY_QWEN2_MOE.items() if k != "num_experts"}
    assert experts({**data, "num_local_experts": 6}).n_experts == 60


def test_aux_loss_only_when_router_logits_are_returned() -> None:
    data = {**TINY_OLMOE, "router_aux_loss_coef": 0.02}
    assert experts(data).aux_loss_coef == 0.0  # output_router_logits false: transformers computes no aux loss
    assert experts({**data, "output_router_logits": True}).aux_loss_coef == 0.02
    # absent coefficient: the config class's default (OlmoeConfig 0.01)
    assert experts({**TINY_OLMOE, "output_router_logits": True}).aux_loss_coef == 0.01


def test_sliding_window_set_but_unused_is_fine() -> None:
    # Qwen2-MoE/Qwen3-MoE window only with use_sliding_window; Qwen2-MoE only layers below max_window_layers
    model_from_hf_config({**TINY_QWEN2_MOE, "sliding_window": 32, "use_sliding_window": False})
    model_from_hf_config({**TINY_QWEN2_MOE, "use_sliding_window": True, "max_window_layers": 0})
    model_from_hf_config({**TINY_QWEN2_MOE, "layer_types": ["full_attention"] * 4})
    model_from_hf_config({**TINY_QWEN3_MOE, "sliding_window": 32, "use_sliding_window": False})
    model_from_hf_config({**TINY_QWEN3_MOE, "sliding_window": None, "use_sliding_window": True})
    model_from_hf_config({**TINY_MIXTRAL, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})


def test_config_json_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN3_30B_A3B, "_name_or_path": "Qwen/Qwen3-30B-A3B"}))
    model = load_workload(path).model
    assert model.name == "Qwen3-30B-A3B" and model.family is Family.QWEN3_MOE and model.attention_head_dim == 128


# ---------------------------------------------------------------------------------------------
# refusals: one line naming the field


REFUSALS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    # sliding layers without a window (use_sliding_window false): transformers' sliding mask raises
    ("qwen2_moe layer types", {**TINY_QWEN2_MOE, "layer_types": ["sliding_attention", "full_attention"] * 2},
     ("layer_types", "use_sliding_window")),
    ("qwen3_moe yarn", {**TINY_QWEN3_MOE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     ("rope_scaling", "yarn")),
    ("mixtral linear rope", {**TINY_MIXTRAL, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     ("rope_parameters", "linear")),
    ("olmoe old-style rope", {**TINY_OLMOE, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     ("rope_scaling", "dynamic")),
    ("qwen2_moe dense in the middle", {**TINY_QWEN2_MOE, "mlp_only_layers": [1]}, ("mlp_only_layers", "[1]")),
    ("qwen3_moe dense not leading", {**TINY_QWEN3_MOE, "mlp_only_layers": [0, 2]}, ("mlp_only_layers", "[0, 2]")),
    ("qwen3_moe bad list", {**TINY_QWEN3_MOE, "mlp_only_layers": "0"}, ("mlp_only_layers", "list")),
    ("olmoe clip_qkv", {**TINY_OLMOE, "clip_qkv": 8.0}, ("clip_qkv", "null")),
    ("olmoe head_dim", {**TINY_OLMOE, "head_dim": 32}, ("head_dim", "32", "hidden_size")),
    ("mixtral jitter", {**TINY_MIXTRAL, "router_jitter_noise": 0.01}, ("router_jitter_noise", "0")),
    ("top-k over experts", {**TINY_OLMOE, "num_experts_per_tok": 9}, ("num_experts_per_tok", "num_experts")),
    ("no experts", {**TINY_QWEN2_MOE, "num_experts": 0}, ("num_experts", "positive integer")),
    ("qwen3_moe kv null", {**TINY_QWEN3_MOE, "num_key_value_heads": None}, ("num_key_value_heads", "null")),
    ("qwen2_moe shared size 0", {**TINY_QWEN2_MOE, "shared_expert_intermediate_size": 0},
     ("shared_expert_intermediate_size",)),
    ("qwen2_moe bad norm_topk_prob", {**TINY_QWEN2_MOE, "norm_topk_prob": "yes"}, ("norm_topk_prob", "true or false")),
    ("mixtral gelu", {**TINY_MIXTRAL, "hidden_act": "gelu"}, ("hidden_act", "gelu")),
]


@pytest.mark.parametrize(("case", "data", "needles"), REFUSALS, ids=[case for case, _, _ in REFUSALS])
def test_refusals_are_one_line_naming_the_field(case: str, data: dict[str, Any], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config(data)
    one_line_error(excinfo, "transformers config", *needles)


def test_refusal_from_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_MIXTRAL, "router_jitter_noise": 0.25}))
    with pytest.raises(ConfigError) as excinfo:
        load_workload(path)
    one_line_error(excinfo, "config.json", "router_jitter_noise")


def test_unsupported_model_type_lists_the_moe_types() -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**TINY_MIXTRAL, "model_type": "dbrx"})
    one_line_error(excinfo, "model_type", "dbrx", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


# ---------------------------------------------------------------------------------------------
# torch and transformers from here on: defaults and exact parameter counts on the meta device

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# hidden 256 / 16 heads: the default KV heads of every type divide 16 (Mixtral 8, Qwen2-MoE 16, Qwen3-MoE 4)
_MINIMAL = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 16, "intermediate_size": 96,
            "vocab_size": 100}


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_omitted_keys_take_transformers_defaults(model_type: str) -> None:
    data = {"model_type": model_type, **_MINIMAL}
    model = model_from_hf_config(data)
    config = transformers.AutoConfig.for_model(**data)
    assert model.tie_embeddings is bool(config.tie_word_embeddings)
    assert model.max_seq_len == config.max_position_embeddings
    assert model.norm_eps == config.rms_norm_eps
    assert model.rope_theta == config.rope_parameters["rope_theta"]
    assert model.dropout == config.attention_dropout
    assert model.kv_heads == config.num_key_value_heads
    moe = model.moe
    assert moe is not None and moe.n_experts == config.num_experts and moe.top_k == config.num_experts_per_tok
    assert moe.d_ff_expert == getattr(config, "moe_intermediate_size", config.intermediate_size)
    assert moe.shared_d_ff == getattr(config, "shared_expert_intermediate_size", 0)
    assert moe.norm_topk_prob is (model_type == "mixtral" or config.norm_topk_prob)
    assert moe.every == getattr(config, "decoder_sparse_step", 1)
    assert not config.output_router_logits and moe.aux_loss_coef == 0.0
    bias = config.qkv_bias if model_type == "qwen2_moe" else getattr(config, "attention_bias", False)
    assert model.qkv_bias is bias
    assert model.attention_head_dim is None and getattr(config, "head_dim", None) in (None, 16)
    assert planner_count(model) == hf_count(config)


def hf_model(data: dict[str, Any]) -> Any:
    config = transformers.AutoConfig.for_model(**copy.deepcopy(data))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def hf_count(config: Any) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def planner_count(model: Any) -> int:
    return sum(param_tensors(model).values())


_LAYER = re.compile(r"^(?:model\.layers|blocks)\.\d+\.")


def _per_kind(sizes: dict[str, int]) -> dict[str, int]:
    """Element counts summed over blocks, by the name after the block index (for a readable diff)."""
    totals: dict[str, int] = {}
    for name, numel in sizes.items():
        key = _LAYER.sub("<block>.", name)
        totals[key] = totals.get(key, 0) + numel
    return totals


def assert_counts_equal(data: dict[str, Any], model: Any) -> None:
    hf = hf_model(data)
    hf_sizes = {name: p.numel() for name, p in hf.named_parameters()}
    ours = param_tensors(model)
    assert sum(ours.values()) == sum(hf_sizes.values()), (
        f"planner {sum(ours.values()):,} vs transformers {sum(hf_sizes.values()):,}; "
        f"per kind, planner {_per_kind(ours)} vs transformers {_per_kind(hf_sizes)}")


@pytest.mark.parametrize(("case", "data"), TINY_VARIANTS, ids=[case for case, _ in TINY_VARIANTS])
def test_tiny_count_equals_transformers(case: str, data: dict[str, Any]) -> None:
    assert_counts_equal(data, model_from_hf_config(data))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_count_is_the_published_total(name: str) -> None:
    """The config dicts above are the published models: transformers builds exactly their totals."""
    data, total = PUBLISHED[name]
    assert sum(p.numel() for p in hf_model(data).parameters()) == total


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_size_count_equals_transformers(name: str) -> None:
    data, total = PUBLISHED[name]
    model = model_from_hf_config(data, name)
    assert_counts_equal(data, model)
    assert planner_count(load_preset(name).model) == total
