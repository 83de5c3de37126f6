"""Gemma 2 and Gemma 3 (model_type gemma2, gemma3_text, gemma3's text model; issue 21): norms before
and after each branch (Gemma RMSNorm, times 1 + w), the GeGLU MLP, query_pre_attn_scalar, per-head
q/k norms (Gemma 3), sliding/global layers with two RoPE bases (Gemma 3), the embedding scaled by
sqrt(D), tied embeddings; Gemma 2's soft-capping of the eager scores and of the logits (c tanh(x / c),
refused under flash attention). The reader field by field, parameters exactly transformers 5.24.0's
(meta device), FLOPs equal to FlopCounterMode and the peak within 1% of the live-storage tracker over
the reference model.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from reader_checks import assert_counts_match, assert_flops_match_transformers, assert_matches_pytorch

from hardware.dtypes import DType
from hardware.registry import load_hardware
from planner.errors import ConfigError, ConfigWarning
from planner.graph.blocks import describe
from planner.graph.params import count_params
from planner.model.config import (
    AttentionImpl,
    Family,
    LayerType,
    MlpKind,
    ModelConfig,
    NormKind,
    NormPlacement,
    QkNorm,
)
from planner.model.families.config_json import model_from_hf_config
from planner.model.sources import load_preset, resolve
from planner.ops.base import LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.catalog import cost_of
from planner.plan.knobs import Knobs
from planner.precision import precision_spec

HW = load_hardware("h100-sxm")

# google/gemma-3-12b-pt (https://huggingface.co/google/gemma-3-12b-pt/blob/main/config.json)
GEMMA3_12B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
GEMMA3_12B_PARAMS = 11_766_034_176  # transformers 5.24.0's Gemma3ForCausalLM of its text_config, meta device

# google/gemma-2-9b (https://huggingface.co/google/gemma-2-9b/blob/main/config.json)
GEMMA2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000,
}
GEMMA2_9B_PARAMS = 9_241_705_984  # transformers 5.24.0's Gemma2ForCausalLM of it, meta device

_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 48, "intermediate_size": 344, "vocab_size": 512,
          "max_position_embeddings": 256, "sliding_window": 32, "sliding_window_pattern": 2,
          "query_pre_attn_scalar": 32, **_NO_TOKENS}
GEMMA2 = {**{k: v for k, v in GEMMA3.items() if k != "sliding_window_pattern"}, "model_type": "gemma2"}  # capped 50, 30
VARIANTS: dict[str, dict[str, Any]] = {
    "gemma3": GEMMA3,
    "gemma3, window 64, untied, biases": {**GEMMA3, "sliding_window": 64, "tie_word_embeddings": False,
                                           "attention_bias": True},
    "gemma2": GEMMA2,
}


def test_gemma3_12b_text_model_and_the_vision_tower_warning() -> None:
    with pytest.warns(ConfigWarning, match="text model .* is planned; the SigLIP vision tower .* not"):
        model = model_from_hf_config(GEMMA3_12B, "gemma3-12b")
    assert model.family is Family.GEMMA3_TEXT
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.head_dim, model.d_ff,
            model.vocab_size, model.max_seq_len) == (48, 3840, 16, 8, 256, 15360, 262208, 131072)
    assert (model.norm, model.norm_placement, model.mlp, model.qk_norm) == (
        NormKind.GEMMA_RMSNORM, NormPlacement.SANDWICH, MlpKind.GEGLU, QkNorm.HEAD)
    assert model.tie_embeddings and model.scale_embeddings and not (model.qkv_bias or model.mlp_bias)
    assert (model.rope_theta, model.rope_local_theta, model.query_pre_attn_scalar, model.norm_eps) == (
        1e6, 1e4, 256.0, 1e-6)
    assert model.sliding_window == 1024 and model.layer_types is not None
    assert [b for b, t in enumerate(model.layer_types) if t is LayerType.FULL] == list(range(5, 48, 6))
    assert count_params(model) == GEMMA3_12B_PARAMS  # transformers' own: test_param_counts.py builds the preset's


@pytest.mark.parametrize(("name", "data"), [("gemma3-12b", GEMMA3_12B), ("gemma2-9b", GEMMA2_9B)])
def test_preset_is_its_published_config(name: str, data: dict[str, Any]) -> None:
    preset = load_preset(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        read = model_from_hf_config(data, name)
    assert preset.model.model_dump(exclude={"activation"}) == read.model_dump(exclude={"activation"})
    assert preset.training is not None and preset.model.window_refusal(preset.training.seq_len) is None


def test_gemma2_9b_counts_and_soft_caps() -> None:
    model = model_from_hf_config(GEMMA2_9B, "gemma2-9b")
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.head_dim, model.d_ff,
            model.vocab_size, model.max_seq_len, model.sliding_window) == (
        42, 3584, 16, 8, 256, 14336, 256000, 8192, 4096)
    assert (model.attn_logit_softcapping, model.final_logit_softcapping, model.attention) == (
        50.0, 30.0, AttentionImpl.EAGER)
    assert count_params(model) == GEMMA2_9B_PARAMS  # transformers' own: test_param_counts.py builds the preset's


def test_gemma2_defaults_and_eager_attention() -> None:
    model = model_from_hf_config(GEMMA2)
    assert model.family is Family.GEMMA2 and model.attention is AttentionImpl.EAGER  # no SDPA path in transformers
    assert model.qk_norm is QkNorm.NONE and model.rope_local_theta is None and not model.local_rope
    assert model.layer_types == (LayerType.SLIDING, LayerType.FULL)  # every 2nd layer full
    assert (model.attn_logit_softcapping, model.final_logit_softcapping) == (50.0, 30.0)  # Gemma2Config's defaults
    capped = describe(model)
    assert [op.name for op in capped.ops][-3:] == ["lm_head", "logits_softcap", "loss"]
    assert dict(next(op for op in capped.ops if op.name == "blocks.0.attn.core").fields)["softcap"] is True
    plain = describe(model_from_hf_config({**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None}))
    assert "logits_softcap" not in [op.name for op in plain.ops]
    assert "softcap" not in dict(next(op for op in plain.ops if op.name == "blocks.0.attn.core").fields)


def test_logit_softcap_saves_tanh_output() -> None:
    """(B, T, V) in, the same out in its dtype; tanh's output saved, neither the logits nor the quotient."""
    spec = LayerSpec(name="logits_softcap", kind=OpKind.LOGIT_SOFTCAP)
    logits = TensorInfo(numel=2 * 64 * 512, dtype=DType.BF16)
    cost = cost_of(spec, OpContext(batch=2, seq_len=64, precision=precision_spec("bf16-mixed"), inputs=(logits,)))
    assert (cost.output, cost.saves_inputs, cost.saved_extra_bytes) == (logits, (False,), (logits.n_bytes,))
    assert (cost.fwd_flops, cost.bwd_flops) == (0.0, 0.0)  # FlopCounterMode counts no elementwise op


def test_soft_capping_where_it_is_not_priced_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve(GEMMA2, seq_len=32, global_batch_size=2, attention="flash")  # SDPA has no soft-capping
    message = str(excinfo.value)
    assert "attn_logit_softcapping" in message and "--attention eager" in message and "\n" not in message
    model = model_from_hf_config(GEMMA2)
    with pytest.raises(ValueError, match="final_logit_softcapping: 30.0: .* plain loss only"):
        ModelConfig.model_validate({**model.model_dump(), "loss": "chunked"})


def test_omitted_keys_take_transformers_defaults() -> None:
    transformers = pytest.importorskip("transformers")
    data = {"model_type": "gemma3_text", "num_hidden_layers": 7, "hidden_size": 256, "num_attention_heads": 8,
            "intermediate_size": 96, "vocab_size": 100}
    model = model_from_hf_config(data)
    config = transformers.AutoConfig.for_model(**data)
    assert (model.max_seq_len, model.norm_eps, model.kv_heads, model.head_dim, model.tie_embeddings) == (
        config.max_position_embeddings, config.rms_norm_eps, config.num_key_value_heads, config.head_dim,
        config.tie_word_embeddings)
    assert (model.sliding_window, model.query_pre_attn_scalar) == (config.sliding_window, config.query_pre_attn_scalar)
    assert [t.value for t in model.layer_types or ()] == config.layer_types
    assert (model.rope_theta, model.rope_local_theta) == (config.rope_parameters["full_attention"]["rope_theta"],
                                                          config.rope_parameters["sliding_attention"]["rope_theta"])


@pytest.mark.parametrize(("data", "key"), [
    ({**GEMMA3, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),  # gemma3 runs SDPA: use eager
    ({**GEMMA2, "hidden_activation": "gelu"}, "hidden_activation"),
    ({**GEMMA3, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GEMMA3, "attention_dropout": 0.1}, "attention_dropout"),
    ({**GEMMA3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
])
def test_what_is_not_priced_is_refused_in_one_line(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config(data)
    message = str(excinfo.value)
    assert key in message and "\n" not in message and "Traceback" not in message


@pytest.mark.parametrize("case", list(VARIANTS))
def test_counts_equal_transformers_and_reference(case: str) -> None:
    assert_counts_match(VARIANTS[case])  # and the same tensors, in the same order, as the reference model


# measured: -0.08% to -0.36% of the tracker (gemma2, both soft-caps: -0.11% fp32, -0.13% bf16-mixed ckpt 0)
CASES = [("gemma3", "eager", "fp32", ()), ("gemma3, window 64, untied, biases", "flash", "bf16-mixed", (0,)),
         ("gemma2", "eager", "fp32", ()), ("gemma2", "eager", "bf16-mixed", (0,))]


@pytest.mark.parametrize(("case", "attention", "precision", "blocks"), CASES,
                         ids=["gemma3-eager-fp32", "gemma3-flash-bf16-mixed-ckpt0", "gemma2-capped-eager-fp32",
                              "gemma2-capped-eager-bf16-mixed-ckpt0"])
def test_planner_matches_pytorch(case: str, attention: str, precision: str, blocks: tuple[int, ...]) -> None:
    """Peak within 1% of the tracker, FLOPs (recompute included) equal."""
    model, training = resolve(VARIANTS[case], seq_len=64, global_batch_size=2, attention=attention)
    assert_matches_pytorch(model, training, Knobs(micro_batch_size=2, precision=precision, checkpoint_blocks=blocks))


@pytest.mark.parametrize("case", ["gemma3", "gemma2"])
def test_flops_equal_flop_counter_on_transformers(case: str) -> None:
    assert_flops_match_transformers(VARIANTS[case])


def test_what_transformers_ignores_or_overrides_is_read_as_it_does() -> None:
    """Review findings against transformers 5.24.0's config classes: Gemma2Config alternates sliding
    and full layers whatever ``sliding_window_pattern`` says; Gemma's MLP never reads ``hidden_act``;
    Gemma3TextConfig's nested ``rope_parameters`` theta wins over a top-level ``rope_theta``."""
    base = {"model_type": "gemma2", "num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "head_dim": 16,
            "sliding_window_pattern": 3, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    assert [t.value for t in model_from_hf_config(base).layer_types] == ["sliding_attention", "full_attention"] * 3
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    gemma3 = model_from_hf_config({**base, "model_type": "gemma3_text", "rope_theta": 5e5, "rope_parameters": nested,
                                   "hidden_act": "gelu"})
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1e6, 1e4)
    assert [t.value for t in gemma3.layer_types] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
