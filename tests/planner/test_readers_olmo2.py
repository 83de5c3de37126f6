"""OLMo 2 (model_type olmo2, issue 21): post-norm blocks (each branch normed before its residual add)
and q/k RMSNorm over all heads. The reader field by field, parameters exactly transformers 5.24.0's
(meta device), FLOPs equal to FlopCounterMode and the peak within 1% of the live-storage tracker
over the reference model.
"""

from __future__ import annotations

from typing import Any

import pytest
from reader_checks import assert_counts_match, hf_count

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.graph.params import count_params
from planner.model.config import Family, ModelConfig, NormPlacement, QkNorm
from planner.model.families.config_json import model_from_hf_config
from planner.model.sources import load_preset, resolve
from planner.plan.knobs import Knobs
from planner.program.estimate import estimate

HW = load_hardware("h100-sxm")

# allenai/OLMo-2-1124-7B (https://huggingface.co/allenai/OLMo-2-1124-7B/blob/main/config.json)
OLMO2_7B: dict[str, Any] = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": 100352,
}
OLMO2_7B_PARAMS = 7_298_617_344  # transformers 5.24.0's Olmo2ForCausalLM on the meta device

_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
TINY = {"model_type": "olmo2", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 344, "vocab_size": 512, "max_position_embeddings": 256,
        **_NO_TOKENS}
VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": TINY,
    "biases, tied, MHA": {**TINY, "attention_bias": True, "tie_word_embeddings": True, "num_key_value_heads": None},
    "head_dim 24": {**TINY, "head_dim": 24},
}


def test_olmo2_7b() -> None:
    model = model_from_hf_config(OLMO2_7B, "olmo2-7b")
    assert model.family is Family.OLMO2
    assert model.norm_placement is NormPlacement.POST and model.qk_norm is QkNorm.FULL
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.d_ff, model.vocab_size) == (
        32, 4096, 32, 32, 11008, 100352)
    assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias or model.tie_embeddings)
    assert (model.max_seq_len, model.norm_eps, model.rope_theta) == (4096, 1e-6, 500000.0)


def test_preset_is_its_published_config() -> None:
    preset = load_preset("olmo2-7b").model.model_dump(exclude={"activation"})
    assert preset == model_from_hf_config(OLMO2_7B, "olmo2-7b").model_dump(exclude={"activation"})


def test_attention_bias_sets_q_k_v_and_o() -> None:
    model = model_from_hf_config({**TINY, "attention_bias": True})
    assert model.qkv_bias and model.attn_out_bias and not model.mlp_bias


def test_post_norm_needs_rmsnorm() -> None:
    with pytest.raises(ValueError, match="norm_placement: post-norm blocks are priced with RMSNorm only"):
        ModelConfig(family="gpt2", n_layers=1, d_model=64, n_heads=4, d_ff=96, vocab_size=64, max_seq_len=64,
                    norm_placement="post")


def test_description_runs_the_norms_after_each_branch() -> None:
    from planner.graph.blocks import describe

    names = [op.name for op in describe(model_from_hf_config(TINY)).ops if op.block == 0]
    assert names.index("blocks.0.attn.o_proj") < names.index("blocks.0.attn_norm") < names.index(
        "blocks.0.attn_residual") < names.index("blocks.0.mlp.gate_proj")
    assert names.index("blocks.0.mlp.down_proj") < names.index("blocks.0.mlp_norm") < names.index(
        "blocks.0.mlp_residual")


def test_published_count_equals_transformers() -> None:
    assert count_params(model_from_hf_config(OLMO2_7B)) == OLMO2_7B_PARAMS == hf_count(OLMO2_7B)


@pytest.mark.parametrize("case", list(VARIANTS))
def test_counts_equal_transformers_and_reference(case: str) -> None:
    assert_counts_match(VARIANTS[case])  # and the same tensors, in the same order, as the reference model


# Every block checkpointed: the peak is in the last block's mlp_norm backward after its recompute,
# where the norm's output gradient is the residual stream's (the add passes it on to both inputs)
# and stays alive (planner.ops.norm.rmsnorm_cost, releases_output_grad).
CASES = [("gqa", "flash", "fp32", (0,)), ("gqa", "eager", "bf16-mixed", (0,)),
         ("biases, tied, MHA", "flash", "bf16-mixed", (0,)), ("head_dim 24", "flash", "bf16-true", ()),
         ("gqa", "flash", "bf16-mixed", (0, 1))]


@pytest.mark.parametrize(("case", "attention", "precision", "blocks"), CASES,
                         ids=["gqa-fp32-ckpt0", "gqa-eager-bf16-mixed-ckpt0", "tied-mha-ckpt0",
                              "head_dim-bf16-true", "gqa-bf16-mixed-ckpt-all"])
def test_planner_matches_pytorch(case: str, attention: str, precision: str, blocks: tuple[int, ...]) -> None:
    """Peak within 1% of the tracker (measured within 0.05%), FLOPs (recompute included) equal."""
    pytest.importorskip("torch")
    from validate.simulate import simulate_step

    model, training = resolve(VARIANTS[case], seq_len=128, global_batch_size=4, attention=attention)
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=2, precision=precision, checkpoint_blocks=blocks)
    predicted = estimate(model, training, HW, knobs)
    measured = simulate_step(model, training, knobs)
    assert predicted.memory.peak_allocated_bytes == pytest.approx(measured.peak_allocated_bytes, rel=0.01)
    assert predicted.hardware_flops_per_step == pytest.approx(measured.flops_per_step, rel=1e-9)


def test_flops_equal_flop_counter_on_transformers() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from validate.flops import transformers_training_flops

    model, training = resolve(TINY, seq_len=32, global_batch_size=2, attention="eager")
    planned = estimate(model, training, HW, Knobs(micro_batch_size=2, precision="fp32")).model_flops_per_step
    assert planned == pytest.approx(transformers_training_flops(TINY, 32, 2), rel=1e-9)


def test_implementation_hf_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="implementation: hf is priced for families") as excinfo:
        ModelConfig.model_validate({**model_from_hf_config(TINY).model_dump(), "implementation": "hf"})
    assert "olmo2" in str(excinfo.value)


def test_olmo2_was_a_known_type() -> None:
    assert isinstance(model_from_hf_config(TINY), ModelConfig)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        model_from_hf_config({**TINY, "hidden_size": 130})
