"""Sliding windows in the mixture-of-experts readers (issue 21, item 2): mixtral's and olmoe's
``sliding_window``, qwen2_moe's ``use_sliding_window`` with its ``layer_types``, qwen3_moe's
``use_sliding_window`` are read as the dense types' (``planner.model.families.dense.windows``) and
priced as the reference model runs them: the peak within 1% of the live-storage tracker and the
FLOPs equal to FlopCounterMode on a tiny windowed MoE at a seq_len past the window.
"""

from __future__ import annotations

from typing import Any

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.model.families.config_json import model_from_hf_config
from planner.model.kinds import LayerType
from planner.model.sources import resolve
from planner.plan.knobs import Knobs
from planner.program.estimate import estimate

HW = load_hardware("h100-sxm")
_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
MIXTRAL = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 128,
           "num_local_experts": 4, "num_experts_per_tok": 2, **_NO_TOKENS}
QWEN2_MOE = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 100,
             "max_position_embeddings": 128, **_NO_TOKENS}
QWEN3_MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 100, "max_position_embeddings": 128,
             **_NO_TOKENS}
OLMOE = {"model_type": "olmoe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
         "vocab_size": 100, "max_position_embeddings": 128, **_NO_TOKENS}


def windows(data: dict[str, Any]) -> list[int | None]:
    model = model_from_hf_config(data)
    return [model.window(b) for b in range(model.n_layers)]


def test_mixtral_and_olmoe_window_every_layer() -> None:
    assert windows({**MIXTRAL, "sliding_window": 16}) == [16, 16]  # MixtralAttention, every layer
    assert windows(MIXTRAL) == [None, None]  # MixtralConfig.sliding_window defaults to None
    assert windows({**MIXTRAL, "sliding_window": None}) == [None, None]
    # OlmoeAttention hands the file's sliding_window to the kernel on every layer
    assert windows({**OLMOE, "sliding_window": 16}) == [16, 16]
    assert windows(OLMOE) == [None, None]


def test_qwen2_moe_windows_the_even_layers_below_max_window_layers() -> None:
    # Qwen2MoeConfig: sliding iff use_sliding_window and (i + 1) % 2 and i < max_window_layers
    on = {**QWEN2_MOE, "use_sliding_window": True, "sliding_window": 16}
    assert windows({**on, "max_window_layers": 3}) == [16, None, 16, None]
    assert windows({**on, "max_window_layers": 1}) == [16, None, None, None]
    assert windows(on) == [16, None, 16, None]  # default max_window_layers 28
    model = model_from_hf_config({**on, "max_window_layers": 1})
    assert model.layer_types == (LayerType.SLIDING, LayerType.FULL, LayerType.FULL, LayerType.FULL)
    # listed layer_types win; without use_sliding_window there is no window at all
    assert windows({**on, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}) == [None, None, None, 16]
    assert windows({**QWEN2_MOE, "sliding_window": 16}) == [None] * 4
    assert windows({**on, "max_window_layers": 0}) == [None] * 4


def test_qwen3_moe_windows_every_layer_when_switched_on() -> None:
    assert windows({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 16}) == [16, 16]
    assert windows({**QWEN3_MOE, "use_sliding_window": True}) == [4096, 4096]  # Qwen3MoeConfig's default
    assert windows({**QWEN3_MOE, "sliding_window": 16}) == [None, None]
    # Qwen3MoeModel builds one sliding mask for every layer: layer_types is not read
    assert windows({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 16,
                    "layer_types": ["full_attention"] * 2}) == [16, 16]


def test_a_binding_window_under_flash_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve({**MIXTRAL, "sliding_window": 16}, seq_len=64, global_batch_size=4, attention="flash")
    message = str(excinfo.value)
    assert "\n" not in message and "sliding_window" in message and "--attention eager" in message


def test_sliding_layers_without_a_window_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**QWEN2_MOE, "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert "\n" not in str(excinfo.value) and "layer_types" in str(excinfo.value)


# past its 16-key window, run eagerly with the window mask on block 0 and the causal one on block 1 (both
# masks, the shared expert); tokens x top_k divide by the experts (the reference model's balanced routing)
WINDOWED = {**QWEN2_MOE, "num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 16}


def test_planner_matches_pytorch() -> None:
    """Peak within 1% of the tracker, FLOPs (recompute included) equal to FlopCounterMode."""
    pytest.importorskip("torch")
    from validate.simulate import simulate_step

    model, training = resolve(WINDOWED, seq_len=64, global_batch_size=2, attention="eager")
    assert [model.window(b) for b in range(2)] == [16, None]
    knobs = Knobs(micro_batch_size=2, precision="bf16-mixed", checkpoint_blocks=(0,))
    predicted = estimate(model, training, HW, knobs)
    measured = simulate_step(model, training, knobs)
    assert predicted.memory.peak_allocated_bytes == pytest.approx(measured.peak_allocated_bytes, rel=0.01)
    assert predicted.hardware_flops_per_step == pytest.approx(measured.flops_per_step, rel=1e-9)


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"])
def test_window_defaults_are_transformers(model_type: str) -> None:
    """The MoE types' window keys in ``WINDOW_DEFAULTS`` are their config classes' defaults (transformers
    5.24.0; OlmoeConfig has no window field: None)."""
    transformers = pytest.importorskip("transformers")
    from planner.model.families.dense.windows import WINDOW_DEFAULTS

    classes = {"mixtral": "MixtralConfig", "olmoe": "OlmoeConfig", "qwen2_moe": "Qwen2MoeConfig",
               "qwen3_moe": "Qwen3MoeConfig"}
    fields = getattr(transformers, classes[model_type]).__dataclass_fields__
    for key, value in WINDOW_DEFAULTS[model_type].items():
        assert (fields[key].default if key in fields else None) == value, key
