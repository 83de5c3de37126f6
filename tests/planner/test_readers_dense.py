"""Dense transformers configs beyond Llama's shape (issue 21): sliding windows in mistral/qwen2/qwen3
files, explicit head dims (Mistral NeMo), and the qwen3 model type. Each file is read field by field,
its parameters counted against transformers 5.24.0 on the meta device (exactly), its FLOPs against
FlopCounterMode and its peak against the live-storage tracker over the reference model (within 1%).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from reader_checks import assert_flops_match_transformers

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.graph.params import count_params
from planner.model.config import AttentionImpl, Family, LayerType, ModelConfig, QkNorm, TrainConfig
from planner.model.families.config_json import model_from_hf_config
from planner.model.sources import load_preset, resolve
from planner.plan.knobs import Knobs
from planner.program.estimate import estimate

HW = load_hardware("h100-sxm")

# ---------------------------------------------------------------------------------------------
# the published config.json files (the keys transformers reads; ids of the Hugging Face repos)

# mistralai/Mistral-7B-v0.1 (https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json)
MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
# mistralai/Mistral-Nemo-Base-2407 (https://huggingface.co/mistralai/Mistral-Nemo-Base-2407/blob/main/config.json)
MISTRAL_NEMO: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 1024000, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True,
    "vocab_size": 131072,
}
# Qwen/Qwen3-8B (https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json)
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}

_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
TINY_MISTRAL = {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 256,
                "sliding_window": None, **_NO_TOKENS}
TINY_QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 256,
              **_NO_TOKENS}
TINY_QWEN3 = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 96, "vocab_size": 256,
              "max_position_embeddings": 256, **_NO_TOKENS}

# name -> (config.json, parameters as transformers 5.24.0 builds them on the meta device)
PUBLISHED: dict[str, tuple[dict[str, Any], int]] = {
    "mistral-7b-v0.1": (MISTRAL_7B_V01, 7_241_732_096),
    "mistral-nemo-base-2407": (MISTRAL_NEMO, 12_247_782_400),
    "qwen3-8b": (QWEN3_8B, 8_190_735_360),
}
# small files with what changes tensors: explicit head dims, biases, tied embeddings, windows
TINY_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("mistral head_dim 24", {**TINY_MISTRAL, "head_dim": 24}),
    ("mistral window 16", {**TINY_MISTRAL, "sliding_window": 16}),
    ("qwen2 head_dim 8", {**TINY_QWEN2, "head_dim": 8}),
    ("qwen2 windows from layer 2", {**TINY_QWEN2, "use_sliding_window": True, "sliding_window": 16,
                                    "max_window_layers": 2}),
    ("llama head_dim 24", {**TINY_MISTRAL, "model_type": "llama", "head_dim": 24}),
    ("qwen3", TINY_QWEN3),
    ("qwen3 biases, tied", {**TINY_QWEN3, "attention_bias": True, "tie_word_embeddings": True}),
    ("qwen3 head_dim = D/N", {**TINY_QWEN3, "head_dim": 16}),
    ("qwen3 head_dim absent (128)", {k: v for k, v in TINY_QWEN3.items() if k != "head_dim"}),
]
IDS = [case for case, _ in TINY_VARIANTS]


def one_line(excinfo: pytest.ExceptionInfo[ConfigError], *needles: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def hf_count(data: dict[str, Any]) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**copy.deepcopy(data))
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in net.parameters())


# ---------------------------------------------------------------------------------------------
# the readers, field by field


def test_mistral_7b_v01_window_is_read() -> None:
    model = model_from_hf_config(MISTRAL_7B_V01, "mistral-7b-v0.1")
    assert model.family is Family.MISTRAL and model.sliding_window == 4096 and model.layer_types is None
    assert [model.window(b) for b in (0, 31)] == [4096, 4096]  # MistralAttention: every layer slides


def test_mistral_window_absent_is_the_class_default_and_null_is_none() -> None:
    data = {k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}
    assert model_from_hf_config(data).sliding_window == 4096  # MistralConfig.sliding_window
    assert model_from_hf_config({**data, "sliding_window": None}).sliding_window is None


def test_a_window_that_binds_is_refused_under_flash_in_one_line() -> None:
    """Mistral-7B-v0.1 at 8192 tokens was priced as full attention; now: one line naming the key."""
    with pytest.raises(ConfigError) as excinfo:
        resolve(MISTRAL_7B_V01, seq_len=8192, global_batch_size=8)
    one_line(excinfo, "sliding_window", "4096", "8192", "--attention eager", "--seq-len 4096")


def test_a_window_that_masks_nothing_prices_as_full_attention() -> None:
    """At T <= W the window masks nothing: the same figures as without it."""
    windowed, train = resolve(MISTRAL_7B_V01, seq_len=4096, global_batch_size=8)
    plain, _ = resolve({**MISTRAL_7B_V01, "sliding_window": None}, seq_len=4096, global_batch_size=8)
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, precision="bf16-mixed", checkpoint_blocks=tuple(range(32)))
    a, b = estimate(windowed, train, HW, knobs), estimate(plain, train, HW, knobs)
    assert a.memory.peak_allocated_bytes == b.memory.peak_allocated_bytes
    assert a.model_flops_per_step == b.model_flops_per_step and a.step_time_s == b.step_time_s


def test_a_binding_window_is_priced_as_eager_attention_runs_it() -> None:
    model, _ = resolve(MISTRAL_7B_V01, seq_len=8192, global_batch_size=8, attention="eager")
    assert model.attention is AttentionImpl.EAGER and model.sliding_window == 4096


def test_estimate_refuses_a_binding_window_under_flash() -> None:
    """Callers that skip resolve get the same refusal from the attention op."""
    model = model_from_hf_config({**TINY_MISTRAL, "sliding_window": 16})
    with pytest.raises(ConfigError, match="sliding_window: 16 keys per query is below seq_len 64"):
        estimate(model, TrainConfig(seq_len=64, global_batch_size=2), HW, Knobs(micro_batch_size=2))


def test_hf_implementation_needs_the_sequence_below_the_window() -> None:
    # transformers builds the window mask once T reaches W (masking_utils._ignore_causal_mask_sdpa)
    model = ModelConfig.model_validate({**model_from_hf_config({**TINY_MISTRAL, "sliding_window": 64}).model_dump(),
                                        "implementation": "hf"})
    assert model.window_refusal(63) is None
    assert "transformers masks attention" in str(model.window_refusal(64))


def test_qwen2_use_sliding_window_follows_max_window_layers() -> None:
    model = model_from_hf_config({**TINY_QWEN2, "use_sliding_window": True, "sliding_window": 16,
                                  "max_window_layers": 2})
    assert model.sliding_window == 16
    assert [model.window(b) for b in range(4)] == [None, None, 16, 16]
    assert model.layer_types == (LayerType.FULL, LayerType.FULL, LayerType.SLIDING, LayerType.SLIDING)
    # use_sliding_window false (the default): no window, whatever sliding_window says
    assert model_from_hf_config({**TINY_QWEN2, "sliding_window": 16}).sliding_window is None
    # every layer below max_window_layers: no layer slides
    assert model_from_hf_config({**TINY_QWEN2, "use_sliding_window": True, "max_window_layers": 4}).sliding_window is None


def test_qwen2_binding_window_refused() -> None:
    data = {**TINY_QWEN2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    with pytest.raises(ConfigError) as excinfo:
        resolve(data, seq_len=64, global_batch_size=2)
    one_line(excinfo, "sliding_window", "16", "64")


@pytest.mark.parametrize(("changes", "needles"), [
    ({"layer_types": ["sliding_attention"] * 4}, ("layer_types", "use_sliding_window")),
    ({"use_sliding_window": True, "layer_types": ["full_attention"] * 3}, ("layer_types", "3 entries")),
    ({"use_sliding_window": True, "max_window_layers": "all"}, ("max_window_layers", "integer")),
    ({"use_sliding_window": True, "sliding_window": 0}, ("sliding_window", "positive")),
])
def test_window_refusals_name_the_key(changes: dict[str, Any], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**TINY_QWEN2, **changes})
    one_line(excinfo, *needles)


def test_mistral_nemo_head_dim_is_honoured() -> None:
    model = model_from_hf_config(MISTRAL_NEMO, "mistral-nemo-base-2407")
    assert (model.d_model, model.n_heads, model.head_dim, model.attention_head_dim) == (5120, 32, 128, 128)
    assert model.sliding_window is None


def test_llama_still_needs_hidden_divisible_by_heads() -> None:
    # LlamaConfig.validate_architecture refuses it even with head_dim; MistralConfig does not
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**TINY_MISTRAL, "model_type": "llama", "hidden_size": 66, "head_dim": 16})
    one_line(excinfo, "num_attention_heads", "66")
    assert model_from_hf_config({**TINY_MISTRAL, "hidden_size": 66, "head_dim": 16}).head_dim == 16


def test_qwen3_8b() -> None:
    model = model_from_hf_config(QWEN3_8B, "qwen3-8b")
    assert model.family is Family.QWEN3 and model.qk_norm is QkNorm.HEAD
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.head_dim, model.d_ff) == (
        36, 4096, 32, 8, 128, 12288)
    assert model.attention_head_dim is None  # 4096 / 32 = 128 already
    assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias or model.tie_embeddings)
    assert (model.max_seq_len, model.norm_eps, model.rope_theta, model.vocab_size) == (40960, 1e-6, 1e6, 151936)
    assert model.sliding_window is None


def test_qwen3_head_dim_defaults_and_null() -> None:
    data = {k: v for k, v in TINY_QWEN3.items() if k != "head_dim"}
    assert model_from_hf_config(data).head_dim == 128  # Qwen3Config.head_dim
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**TINY_QWEN3, "head_dim": None})
    one_line(excinfo, "head_dim", "null")


def test_qwen3_preset_is_its_published_config() -> None:
    preset = load_preset("qwen3-8b").model.model_dump(exclude={"activation"})
    assert preset == model_from_hf_config(QWEN3_8B, "qwen3-8b").model_dump(exclude={"activation"})


# ---------------------------------------------------------------------------------------------
# parameters: exactly transformers' and the reference model's


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_counts_equal_transformers(name: str) -> None:
    data, expected = PUBLISHED[name]
    assert count_params(model_from_hf_config(data, name)) == expected == hf_count(data)


@pytest.mark.parametrize(("case", "data"), TINY_VARIANTS, ids=IDS)
def test_tiny_counts_equal_transformers_and_reference(case: str, data: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    from validate.reference_model import build_model

    model = model_from_hf_config(data)
    with torch.device("meta"):
        reference = sum(p.numel() for p in build_model(model).parameters())
    assert count_params(model) == hf_count(data) == reference


# ---------------------------------------------------------------------------------------------
# FLOPs and memory against PyTorch (reference model under fake tensors: tracker, FlopCounterMode)

# (case, attention, seq_len, precision): windows at a seq_len past them run eagerly, the window
# mask applied; each case in one precision, both precisions over the set (the suite's time budget)
PRICED = [("mistral head_dim 24", "flash", 64, "bf16-mixed"), ("mistral window 16", "eager", 64, "fp32"),
          ("qwen2 windows from layer 2", "eager", 64, "bf16-mixed"), ("qwen3", "flash", 64, "fp32"),
          ("qwen3", "flash", 64, "bf16-mixed"), ("qwen3 biases, tied", "eager", 64, "fp32")]


@pytest.mark.parametrize(("case", "attention", "seq_len", "precision"), PRICED,
                         ids=[f"{p}-{c}-{a}" for c, a, _, p in PRICED])
def test_planner_matches_pytorch(case: str, attention: str, seq_len: int, precision: str) -> None:
    """Peak within 1% of the live-storage tracker, FLOPs (recompute included) equal to FlopCounterMode."""
    pytest.importorskip("torch")
    from validate.simulate import simulate_step

    model, training = resolve(dict(TINY_VARIANTS)[case], seq_len=seq_len, global_batch_size=4, attention=attention)
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=2, precision=precision, checkpoint_blocks=(0,))
    predicted = estimate(model, training, HW, knobs)
    measured = simulate_step(model, training, knobs)
    assert predicted.memory.peak_allocated_bytes == pytest.approx(measured.peak_allocated_bytes, rel=0.01)
    assert predicted.hardware_flops_per_step == pytest.approx(measured.flops_per_step, rel=1e-9)


@pytest.mark.parametrize("case", ["mistral head_dim 24", "qwen3 biases, tied"])
def test_flops_equal_flop_counter_on_transformers(case: str) -> None:
    """transformers' own model (eager attention) does the FLOPs the planner counts."""
    assert_flops_match_transformers(dict(TINY_VARIANTS)[case])


# ---------------------------------------------------------------------------------------------
# what a read family runs that is not priced yet: one line naming the key (Gemma's bidirectional
# attention; tests/planner/test_readers_gemma.py and test_readers_phi3.py refuse the others)


def test_unpriced_parts_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**TINY_MISTRAL, "model_type": "gemma2", "sliding_window": 32,
                              "use_bidirectional_attention": True})
    one_line(excinfo, "use_bidirectional_attention", "not priced")
