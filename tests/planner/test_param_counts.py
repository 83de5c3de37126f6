"""Exact parameter counts: planner.graph.params vs transformers and the reference model, on the meta device.

Nothing is allocated (meta tensors), so even Llama 3.1 405B builds in well under a second.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from planner.graph.params import count_params, param_tensors  # noqa: E402
from planner.model.config import Family, ModelConfig  # noqa: E402
from planner.model.sources import list_presets, load_preset, model_from_hf_config  # noqa: E402
from validate.reference_model import build_model  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
HF_FIXTURES = ("gpt2", "llama", "mistral", "qwen2")


def hf_config_for(model: ModelConfig) -> Any:
    """The transformers config of the same architecture as ``model``."""
    if model.family is Family.GPT2:
        return transformers.GPT2Config(
            vocab_size=model.vocab_size, n_positions=model.max_seq_len, n_embd=model.d_model,
            n_layer=model.n_layers, n_head=model.n_heads, n_inner=model.d_ff,
            layer_norm_epsilon=model.norm_eps, tie_word_embeddings=model.tie_embeddings,
            activation_function="gelu_new", resid_pdrop=model.dropout, embd_pdrop=model.dropout,
            attn_pdrop=model.dropout, bos_token_id=None, eos_token_id=None,
        )
    common = {
        "vocab_size": model.vocab_size, "hidden_size": model.d_model, "intermediate_size": model.d_ff,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads, "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
        "tie_word_embeddings": model.tie_embeddings, "attention_dropout": model.dropout,
        "bos_token_id": None, "eos_token_id": None,
    }
    if model.family is Family.LLAMA:
        assert model.qkv_bias == model.attn_out_bias  # one switch in transformers
        return transformers.LlamaConfig(attention_bias=model.qkv_bias, mlp_bias=model.mlp_bias, **common)
    if model.family is Family.MISTRAL:
        assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias)
        return transformers.MistralConfig(**common)
    if model.family is Family.OLMO2:
        assert model.qkv_bias == model.attn_out_bias and not model.mlp_bias  # one attention_bias switch
        return transformers.Olmo2Config(attention_bias=model.qkv_bias, head_dim=model.head_dim, **common)
    if model.family is Family.QWEN3:
        assert model.qkv_bias == model.attn_out_bias and not model.mlp_bias  # one attention_bias switch
        return transformers.Qwen3Config(attention_bias=model.qkv_bias, head_dim=model.head_dim, **common)
    if model.family is Family.GEMMA3_TEXT:
        assert model.qkv_bias == model.attn_out_bias and not model.mlp_bias  # one attention_bias switch
        return transformers.Gemma3TextConfig(
            attention_bias=model.qkv_bias, head_dim=model.head_dim, sliding_window=model.sliding_window,
            layer_types=[t.value for t in model.layer_types or ()] or None, **common)
    if model.family is Family.GEMMA2:
        assert model.qkv_bias == model.attn_out_bias and not model.mlp_bias  # one attention_bias switch
        return transformers.Gemma2Config(
            attention_bias=model.qkv_bias, head_dim=model.head_dim, sliding_window=model.sliding_window,
            query_pre_attn_scalar=int(model.query_pre_attn_scalar or 256), attn_logit_softcapping=model.attn_logit_softcapping,
            final_logit_softcapping=model.final_logit_softcapping,
            layer_types=[t.value for t in model.layer_types or ()] or None, **common)
    if model.family is Family.PHI3:
        assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias)  # Phi3Attention/Phi3MLP: no biases
        return transformers.Phi3Config(sliding_window=model.sliding_window, **common)
    assert model.family is Family.QWEN2
    assert model.qkv_bias and not model.attn_out_bias and not model.mlp_bias
    return transformers.Qwen2Config(**common)


def hf_param_count(config: Any) -> int:
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in hf_model.parameters())


def reference_param_count(model: ModelConfig) -> int:
    with torch.device("meta"):
        reference = build_model(model)
    return sum(p.numel() for p in reference.parameters())


def load_fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


# ---------------------------------------------------------------------------------------------
# every preset


# MoE presets: tests/planner/test_hf_config_moe.py builds transformers' model from their published config.json
@pytest.mark.parametrize("name", [name for name in list_presets() if load_preset(name).model.moe is None])
def test_preset_count_equals_transformers(name: str) -> None:
    model = load_preset(name).model
    assert count_params(model) == hf_param_count(hf_config_for(model))


@pytest.mark.parametrize("name", list_presets())
def test_preset_count_equals_reference_model(name: str) -> None:
    model = load_preset(name).model
    with torch.device("meta"):
        reference = build_model(model)
    assert count_params(model) == sum(p.numel() for p in reference.parameters())
    # same names and sizes, tensor by tensor (a tied head is listed once)
    assert {n: p.numel() for n, p in reference.named_parameters()} == param_tensors(model)


# Published totals, extra golden checks (the architectures above are checked in test_model_io).
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # GPT-2 small (12 layers, d 768, vocab 50257, n_ctx 1024, tied): 124,439,808
        # (docs/references.md "Parameter counts"; the count transformers reports for openai-community/gpt2).
        ("gpt2", 124_439_808),
        # Llama-2-7B (32 layers, d 4096, d_ff 11008, vocab 32000, untied): 6,738,415,616
        # (docs/references.md "Parameter counts"; the safetensors total of meta-llama/Llama-2-7b-hf).
        ("llama2-7b", 6_738_415_616),
    ],
)
def test_published_totals(name: str, expected: int) -> None:
    assert count_params(load_preset(name).model) == expected


# ---------------------------------------------------------------------------------------------
# transformers config.json files


@pytest.mark.parametrize("fixture", HF_FIXTURES)
def test_config_json_count_equals_transformers(fixture: str) -> None:
    data = load_fixture(fixture)
    model = model_from_hf_config(data)
    hf_count = hf_param_count(transformers.AutoConfig.for_model(**data))
    assert count_params(model) == hf_count
    assert reference_param_count(model) == hf_count


def test_fixtures_cover_the_interesting_cases() -> None:
    qwen2 = model_from_hf_config(load_fixture("qwen2"))
    assert qwen2.tie_embeddings and qwen2.kv_heads < qwen2.n_heads
    llama = model_from_hf_config(load_fixture("llama"))
    assert not llama.qkv_bias and llama.kv_heads < llama.n_heads
    assert model_from_hf_config(load_fixture("gpt2")).d_ff == 4 * 128  # n_inner null


@pytest.mark.parametrize(("attention_bias", "mlp_bias"), [(True, False), (False, True), (True, True)])
def test_llama_biases_count_equals_transformers(attention_bias: bool, mlp_bias: bool) -> None:
    data = load_fixture("llama")
    data.update(attention_bias=attention_bias, mlp_bias=mlp_bias)
    model = model_from_hf_config(data)
    assert model.qkv_bias is attention_bias and model.attn_out_bias is attention_bias
    assert model.mlp_bias is mlp_bias
    hf_count = hf_param_count(transformers.AutoConfig.for_model(**data))
    assert count_params(model) == hf_count == reference_param_count(model)


@pytest.mark.parametrize(
    ("fixture", "changes"),
    [
        ("gpt2", {"tie_word_embeddings": False}),
        ("gpt2", {"n_inner": 200}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": None}),
        ("mistral", {"attention_bias": True}),  # transformers' Mistral has no bias switch: ignored
        ("qwen2", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
    ],
)
def test_config_json_variants_count_equals_transformers(fixture: str, changes: dict[str, Any]) -> None:
    data = {**load_fixture(fixture), **changes}
    model = model_from_hf_config(data)
    assert count_params(model) == hf_param_count(transformers.AutoConfig.for_model(**copy.deepcopy(data)))


# ---------------------------------------------------------------------------------------------
# the defaults model_io assumes for keys a config.json omits are transformers' own

# num_key_value_heads is omitted: MistralConfig defaults it to 8, Qwen2Config to 32, LlamaConfig to MHA
_LLAMA_LIKE = {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 32, "intermediate_size": 96,
               "vocab_size": 100}
_SIZES = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100},
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
}


@pytest.mark.parametrize("model_type", sorted(_SIZES))
def test_omitted_keys_take_transformers_defaults(model_type: str) -> None:
    data = {"model_type": model_type, **_SIZES[model_type]}
    model = model_from_hf_config(data)
    config = transformers.AutoConfig.for_model(**data)
    assert model.tie_embeddings is bool(config.tie_word_embeddings)
    if model_type == "gpt2":
        assert model.max_seq_len == config.n_positions
        assert model.norm_eps == config.layer_norm_epsilon
        assert model.dropout == config.resid_pdrop
        assert model.d_ff == 4 * config.n_embd
    else:
        assert model.max_seq_len == config.max_position_embeddings
        assert model.norm_eps == config.rms_norm_eps
        assert model.rope_theta == config.rope_parameters["rope_theta"]
        assert model.dropout == config.attention_dropout
        assert model.kv_heads == config.num_key_value_heads
        assert model_type != "llama" or (model.qkv_bias is config.attention_bias and model.mlp_bias is config.mlp_bias)
    assert count_params(model) == hf_param_count(config)
