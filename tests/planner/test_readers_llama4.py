"""Llama 4 (model_type llama4_text, and the multimodal llama4 through its text_config; issue 21):
MoE blocks interleaved with dense ones, the sigmoid top-k router scaling the experts' input, the
fused gate_up_proj, the shared expert, no-RoPE blocks with temperature tuning, the q/k L2 norm,
chunked attention (exact up to one chunk, refused past it). The reader field by field, parameters
exactly transformers 5.24.0's (meta device), FLOPs equal to FlopCounterMode and the peak within
1% of the live-storage tracker over the reference model.
"""

from __future__ import annotations

from typing import Any

import pytest
import reader_checks

from hardware.registry import load_hardware
from planner.errors import ConfigError, ConfigWarning
from planner.graph.params import count_params
from planner.model.config import Family
from planner.model.families.config_json import model_from_hf_config
from planner.model.families.moe.config import ExpertActivation, RouterScoring
from planner.model.sources import load_preset, resolve
from planner.plan.knobs import Knobs

HW = load_hardware("h100-sxm")

# meta-llama/Llama-4-Scout-17B-16E config.json's text_config (transformers_version 4.51.0;
# https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json)
SCOUT_TEXT: dict[str, Any] = {
    "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1,
    "attn_temperature_tuning": 4, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
    "floor_scale": 8192, "for_llm_compressor": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "max_position_embeddings": 262144, "model_type": "llama4_text",
    "moe_layers": list(range(48)), "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(48)],
    "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8,
    "num_local_experts": 16, "output_router_logits": False, "pad_token_id": 200018, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 202048,
}
# transformers 5.24.0's Llama4ForCausalLM over SCOUT_TEXT on the meta device (attn_temperature_tuning
# given as true: 5.24.0's strict Llama4TextConfig rejects the file's 4); the text model only
SCOUT_PARAMS = 107_769_861_120

_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
# every other block MoE (1, 3), blocks 1 and 3 without RoPE (temperature), 0 and 2 RoPE (L2 norm)
TINY = {"model_type": "llama4_text", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 32, "intermediate_size_mlp": 48,
        "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
        "no_rope_layer_interval": 2, "max_position_embeddings": 256, **_NO_TOKENS}
VARIANTS: dict[str, dict[str, Any]] = {
    "interleaved": TINY,
    "all MoE, top-2, biases, tied, no qk norm": {**TINY, "interleave_moe_layer_step": 1, "num_experts_per_tok": 2,
                                                "attention_bias": True, "tie_word_embeddings": True,
                                                "use_qk_norm": False},
    "head_dim 24, MHA": {**TINY, "head_dim": 24, "num_key_value_heads": 4},
}


def _bool_tuning(data: dict[str, Any]) -> None:
    """Scout's file writes attn_temperature_tuning: 4, which transformers 5.24's strict config class
    refuses as a bool: read it as True (as the planner does)."""
    if isinstance(data.get("attn_temperature_tuning"), int):
        data["attn_temperature_tuning"] = bool(data["attn_temperature_tuning"])


def hf_count(data: dict[str, Any]) -> int:
    return reader_checks.hf_count(data, _bool_tuning)


def test_scout_text_config() -> None:
    model = model_from_hf_config(SCOUT_TEXT, "llama4-scout")
    assert model.family is Family.LLAMA4_TEXT
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.head_dim, model.d_ff,
            model.vocab_size) == (48, 5120, 40, 8, 128, 16384, 202048)
    moe = model.moe
    assert moe is not None and (moe.n_experts, moe.top_k, moe.d_ff_expert, moe.shared_d_ff) == (16, 1, 8192, 8192)
    assert moe.scoring is RouterScoring.TOPK_SIGMOID and moe.expert_activation is ExpertActivation.FUSED_SWIGLU
    assert not moe.norm_topk_prob and not moe.shared_gate and all(moe.is_sparse(b) for b in range(48))
    settings = model.llama4
    assert settings is not None and settings.nope_layers == tuple(range(3, 48, 4))
    assert settings.qk_l2_norm and settings.temperature_tuning and settings.attention_chunk_size == 8192
    assert (settings.floor_scale, settings.attn_scale, model.rope_theta) == (8192, 0.1, 500000.0)
    assert not (model.qkv_bias or model.attn_out_bias or model.tie_embeddings)


def test_preset_is_its_published_config() -> None:
    preset = load_preset("llama4-scout").model.model_dump(exclude={"activation"})
    assert preset == model_from_hf_config(SCOUT_TEXT, "llama4-scout").model_dump(exclude={"activation"})


def test_multimodal_file_plans_its_text_model_and_says_so() -> None:
    wrapper = {"model_type": "llama4", "text_config": SCOUT_TEXT, "vision_config": {"hidden_size": 1408},
               "tie_word_embeddings": False}
    with pytest.warns(ConfigWarning, match="vision tower") as record:
        model = model_from_hf_config(wrapper, "llama4-scout")
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert model == model_from_hf_config(SCOUT_TEXT, "llama4-scout")


def test_interleaving_and_no_rope_layers() -> None:
    model = model_from_hf_config(TINY)
    assert model.moe is not None and [model.moe.is_sparse(b) for b in range(4)] == [False, True, False, True]
    assert model.llama4 is not None and model.llama4.nope_layers == (1, 3)
    # moe_layers wins over the step; a leading run of dense blocks, then every other one
    listed = model_from_hf_config({**TINY, "num_hidden_layers": 6, "moe_layers": [3, 5]}).moe
    assert listed is not None and [listed.is_sparse(b) for b in range(6)] == [False] * 3 + [True, False, True]
    assert model_from_hf_config({**TINY, "no_rope_layers": [1, 1, 1, 1]}).llama4.nope_layers == ()  # type: ignore[union-attr]
    assert model_from_hf_config({**TINY, "attention_chunk_size": None}).llama4.attention_chunk_size is None  # type: ignore[union-attr]


def test_description_scales_rows_before_the_experts() -> None:
    from planner.graph.blocks import describe

    names = [op.name for op in describe(model_from_hf_config(TINY)).ops if op.block in (0, 1)]
    assert "blocks.0.attn.qk_l2_norm" in names and "blocks.0.attn.temperature" not in names
    assert "blocks.1.attn.temperature" in names and "blocks.1.attn.rotary" not in names
    assert names.index("blocks.1.mlp.route") < names.index("blocks.1.mlp.scale") < names.index(
        "blocks.1.mlp.experts.gate_up_proj") < names.index("blocks.1.mlp.gather") < names.index(
        "blocks.1.mlp.shared_expert.gate_proj")
    assert "blocks.0.mlp.gate_proj" in names  # block 0 is dense (intermediate_size_mlp)


def test_scout_count_equals_transformers() -> None:
    """The published total (transformers on the meta device, measured once: 9 s), and Scout's widths
    at 4 layers counted by transformers here."""
    assert count_params(model_from_hf_config(SCOUT_TEXT)) == SCOUT_PARAMS
    short = {**SCOUT_TEXT, "num_hidden_layers": 4, "moe_layers": [0, 1, 2, 3], "no_rope_layers": [1, 1, 1, 0]}
    assert count_params(model_from_hf_config(short)) == hf_count(short)


@pytest.mark.parametrize("case", list(VARIANTS))
def test_counts_equal_transformers_and_reference(case: str) -> None:
    reader_checks.assert_counts_match(VARIANTS[case], _bool_tuning)


def test_defaults_are_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig

    from planner.model.families.llama4.reader import LLAMA4_DEFAULTS

    config = Llama4TextConfig()
    for key, value in LLAMA4_DEFAULTS.items():
        assert (config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key)) == value, key


# (case, attention, precision, checkpointed blocks), each at 2 blocks: block 0 dense (or MoE) with RoPE and
# the q/k L2 norm, block 1 MoE without RoPE, its q's temperature
PRICED = [("interleaved", "flash", "bf16-mixed", (0, 1)), ("all MoE, top-2, biases, tied, no qk norm", "eager", "fp32", (1,))]


@pytest.mark.parametrize(("case", "attention", "precision", "blocks"), PRICED, ids=[f"{c}-{a}-{p}" for c, a, p, _ in PRICED])
def test_planner_matches_pytorch(case: str, attention: str, precision: str, blocks: tuple[int, ...]) -> None:
    """Peak within 1% of the tracker, FLOPs (recompute included) equal to FlopCounterMode."""
    model, training = resolve({**VARIANTS[case], "num_hidden_layers": 2}, seq_len=64, global_batch_size=2,
                              attention=attention)
    assert model.llama4 is not None and model.llama4.nope_layers == (1,)
    reader_checks.assert_matches_pytorch(model, training,
                                         Knobs(micro_batch_size=2, precision=precision, checkpoint_blocks=blocks))


# ---------------------------------------------------------------------------------------------
# refusals: one line naming the key


def one_line(excinfo: pytest.ExceptionInfo[ConfigError], *needles: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_chunked_attention_past_one_chunk_is_refused() -> None:
    data = {**TINY, "attention_chunk_size": 32}
    resolve(data, seq_len=32, global_batch_size=2)  # one chunk: causal attention, priced
    with pytest.raises(ConfigError) as excinfo:
        resolve(data, seq_len=64, global_batch_size=2)
    one_line(excinfo, "attention_chunk_size", "32", "64", "--seq-len 32")
    resolve({**data, "no_rope_layers": [0] * 4}, seq_len=64, global_batch_size=2)  # no RoPE block: none chunked


REFUSALS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("moe_layers not a layout", {**TINY, "moe_layers": [0, 3]}, ("moe_layers", "[0, 3]")),
    ("no_rope_layers short", {**TINY, "no_rope_layers": [1, 0]}, ("no_rope_layers", "2 entries")),
    ("no_rope_layers values", {**TINY, "no_rope_layers": [1, 2, 1, 0]}, ("no_rope_layers", "1 (RoPE)")),
    ("yarn", {**TINY, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ("rope_parameters", "yarn")),
    ("top-k", {**TINY, "num_experts_per_tok": 5}, ("num_experts_per_tok", "num_local_experts")),
    ("chunked without a chunk", {**TINY, "attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4},
     ("layer_types", "attention_chunk_size")),
    ("text_config", {"model_type": "llama4", "text_config": [1]}, ("text_config", "mapping")),
    ("gelu", {**TINY, "hidden_act": "gelu"}, ("hidden_act", "gelu")),
    ("kv null", {**TINY, "num_key_value_heads": None}, ("num_key_value_heads", "null")),
]


@pytest.mark.parametrize(("case", "data", "needles"), REFUSALS, ids=[case for case, _, _ in REFUSALS])
def test_refusals_are_one_line_naming_the_key(case: str, data: dict[str, Any], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config(data)
    one_line(excinfo, *needles)


def test_expert_parallelism_is_refused_in_one_line() -> None:
    from planner.plan.layout_rules import check_expert_parallel
    from planner.plan.parallel_dims import ParallelDims

    model = model_from_hf_config(TINY)
    with pytest.raises(ConfigError) as excinfo:
        check_expert_parallel(model, ParallelDims(dp_shard=2, ep=2))
    one_line(excinfo, "parallel.ep", "ep 1")
