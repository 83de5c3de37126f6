"""Phi-3 (model_type phi3, issue 21): fused qkv_proj and gate_up_proj (one projection each, its
output split into views), partial rotary, longrope, a window on every layer. The reader field by
field, parameters exactly transformers 5.24.0's (meta device), FLOPs equal to FlopCounterMode
(on transformers' own model and on the reference model) and the peak within 1% of the
live-storage tracker over the reference model.
"""

from __future__ import annotations

from typing import Any

import pytest
from reader_checks import assert_counts_match, assert_flops_match_transformers, assert_matches_pytorch

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.graph.params import count_params, param_tensors
from planner.model.config import Family, ModelConfig
from planner.model.families.config_json import model_from_hf_config
from planner.model.sources import load_preset, resolve
from planner.plan.knobs import Knobs

HW = load_hardware("h100-sxm")

# microsoft/Phi-3-mini-4k-instruct (https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json)
PHI3_MINI: dict[str, Any] = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True, "attention_bias": False,
    "vocab_size": 32064,
}
PHI3_MINI_PARAMS = 3_821_079_552  # transformers 5.24.0's Phi3ForCausalLM on the meta device

_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
TINY = {"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 344, "vocab_size": 512, "max_position_embeddings": 256,
        "partial_rotary_factor": 0.5, **_NO_TOKENS}
# longrope: a factor per rotated frequency (16 rotated dims of 32: 8 each); priced as plain tables
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
             "original_max_position_embeddings": 128}
VARIANTS: dict[str, dict[str, Any]] = {
    "gqa, partial rotary": TINY,
    "mha, tied, window": {**TINY, "num_key_value_heads": None, "tie_word_embeddings": True, "sliding_window": 32,
                          "partial_rotary_factor": 1.0},
    "longrope": {**TINY, "rope_scaling": {**_LONGROPE, "partial_rotary_factor": 0.5}},
}


def test_phi3_mini() -> None:
    model = model_from_hf_config(PHI3_MINI, "phi3-mini")
    assert model.family is Family.PHI3 and model.fused_projections
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.d_ff, model.vocab_size) == (
        32, 3072, 32, 32, 8192, 32064)
    assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias or model.tie_embeddings)
    assert (model.max_seq_len, model.norm_eps, model.rope_theta, model.sliding_window) == (4096, 1e-5, 1e4, 2047)
    assert model.layer_types is None and model.rope_dim == model.head_dim == 96  # every layer slides, all dims rotate


def test_preset_is_its_published_config() -> None:
    preset = load_preset("phi3-mini")
    assert preset.model.model_dump(exclude={"activation"}) == model_from_hf_config(
        PHI3_MINI, "phi3-mini").model_dump(exclude={"activation"})
    assert preset.training is not None and preset.model.window_refusal(preset.training.seq_len) is None


def test_partial_rotary_factor_and_longrope() -> None:
    model = model_from_hf_config(VARIANTS["longrope"])
    assert (model.partial_rotary_factor, model.rope_dim, model.head_dim) == (0.5, 16, 32)
    assert model_from_hf_config(TINY).rope_dim == 16  # the top-level key (Phi3Config's fallback)
    assert model_from_hf_config({**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.25}}).rope_dim == 8


def test_omitted_keys_take_transformers_defaults() -> None:
    transformers = pytest.importorskip("transformers")
    data = {"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 8,
            "intermediate_size": 96, "vocab_size": 100}
    model = model_from_hf_config(data)
    config = transformers.AutoConfig.for_model(**data)
    assert (model.max_seq_len, model.norm_eps, model.kv_heads, model.tie_embeddings, model.sliding_window) == (
        config.max_position_embeddings, config.rms_norm_eps, config.num_key_value_heads, config.tie_word_embeddings,
        config.sliding_window)
    assert model.rope_theta == config.rope_parameters["rope_theta"]
    assert model.rope_dim == model.head_dim * config.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize(("update", "key"), [
    ({"resid_pdrop": 0.1}, "resid_pdrop"), ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"), ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
])
def test_what_is_not_priced_is_refused_in_one_line(update: dict[str, Any], key: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as excinfo:
        model_from_hf_config({**TINY, **update})
    message = str(excinfo.value)
    assert key in message and "\n" not in message.strip() and "Traceback" not in message


def test_published_count_equals_transformers() -> None:
    # transformers' own count of the same architecture: test_param_counts.py builds the preset's on the meta device
    assert count_params(model_from_hf_config(PHI3_MINI)) == PHI3_MINI_PARAMS


@pytest.mark.parametrize("case", list(VARIANTS))
def test_counts_equal_transformers_and_reference(case: str) -> None:
    model = assert_counts_match(VARIANTS[case])
    assert "blocks.0.attn.qkv_proj.weight" in param_tensors(model)


# measured: -0.04% to -0.12% of the tracker (partial rotary's head-major flash output and its merge copy included)
CASES = [("gqa, partial rotary", "flash", "fp32", ()), ("gqa, partial rotary", "flash", "bf16-mixed", (0,)),
         ("mha, tied, window", "eager", "bf16-mixed", (0, 1))]


@pytest.mark.parametrize(("case", "attention", "precision", "blocks"), CASES,
                         ids=["partial-fp32", "partial-bf16-mixed-ckpt0", "window-eager-bf16-mixed-ckpt-all"])
def test_planner_matches_pytorch(case: str, attention: str, precision: str, blocks: tuple[int, ...]) -> None:
    """Peak within 1% of the tracker, FLOPs (recompute included) equal."""
    model, training = resolve(VARIANTS[case], seq_len=64, global_batch_size=2, attention=attention)
    assert_matches_pytorch(model, training, Knobs(micro_batch_size=2, precision=precision, checkpoint_blocks=blocks))


@pytest.mark.parametrize("case", ["gqa, partial rotary", "mha, tied, window"])
def test_flops_equal_flop_counter_on_transformers(case: str) -> None:
    assert_flops_match_transformers(VARIANTS[case])


def test_fused_projections_fit_dense_swiglu_blocks_only() -> None:
    with pytest.raises(ValueError, match="fused_projections: fused qkv_proj/gate_up_proj are priced for dense SwiGLU"):
        ModelConfig(family="gpt2", n_layers=1, d_model=64, n_heads=4, d_ff=96, vocab_size=64, max_seq_len=64,
                    fused_projections=True)
