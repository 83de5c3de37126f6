"""Refusals the planner's core makes that no other test reaches, because the command line, the
API or the search refuses first (or builds only what passes): each called on the core function,
its one-line message naming the field and the fix.

Found with coverage over tests/planner, tests/search and the command tests: ``raise`` lines left
unrun. Where a check can only see a value a validated model or knobs never carry, the test builds
it without validation (``model_copy``), as code that bypasses the validators would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from hardware.errors import ConfigError
from hardware.registry import load_hardware
from hardware.validation import describe_validation_error
from planner.model.config import ModelConfig, TrainConfig
from planner.model.families.moe.config import MoeConfig
from planner.model.sources import model_from_hf_config, resolve
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.plan.schedule import accumulation
from planner.program.estimate import estimate
from planner.program.results import PlanResult

HW = load_hardware("h100-sxm")
MODEL = ModelConfig(family="llama", name="small", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=344,
                    vocab_size=1000, max_seq_len=128)
TRAINING = TrainConfig(seq_len=128, global_batch_size=4)


def one_line(error: pytest.ExceptionInfo[BaseException], *words: str) -> str:
    """The refusal's message, checked to be one line holding ``words``."""
    value = error.value
    message = describe_validation_error(value, "ctx") if isinstance(value, ValidationError) else str(value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


# --- estimate.check_knobs: the API picks knobs that pass (search.space divides the batch, refuses
# the ops policy with --cp; roofplan.api reads --checkpoint against the model's blocks) ---------

def test_estimate_refuses_knobs_that_do_not_make_the_global_batch() -> None:
    with pytest.raises(ConfigError) as error:
        estimate(MODEL, TRAINING, HW, Knobs(micro_batch_size=3))
    one_line(error, "micro_batch_size 3", "global_batch_size is 4", "choose a micro-batch that divides it")


def test_estimate_refuses_a_checkpointed_block_the_model_lacks() -> None:
    with pytest.raises(ConfigError) as error:
        estimate(MODEL, TRAINING, HW, Knobs(micro_batch_size=4, checkpoint_blocks=(0, 5)))
    one_line(error, "knobs.checkpoint_blocks", "block 5", "blocks 0..1")


def test_estimate_refuses_per_op_checkpointing_with_context_parallelism() -> None:
    parallel = ParallelDims.data_parallel_of(2, 3, cp=2)
    knobs = Knobs(micro_batch_size=4, parallel=parallel, checkpoint_blocks=(0,), checkpoint_policy="ops")
    with pytest.raises(ConfigError) as error:
        estimate(MODEL, TrainConfig(seq_len=128, global_batch_size=4), HW, knobs)
    one_line(error, "--checkpoint-policy", "context parallelism", "--cp 1")


def test_estimate_refuses_an_attention_kernel_the_device_lacks() -> None:
    model = ModelConfig.model_validate({**MODEL.model_dump(), "attention_kernel": "flash3"})
    with pytest.raises(ConfigError) as error:
        estimate(model, TRAINING, load_hardware("a100-sxm-80gb"), Knobs(micro_batch_size=4))
    one_line(error, "attention_kernel: flash3", "a100", "flash2", "leave attention_kernel out")


# --- Knobs and ParallelDims validators: the CLI builds them from flags that cannot disagree -----

@pytest.mark.parametrize(("fields", "words"), [
    ({"data_parallel": 0}, ("knobs.data_parallel", "positive integer")),
    ({"data_parallel": 2, "zero_stage": 0, "parallel": {"dp_shard": 2}}, ("disagree with parallel", "give one of them")),
    ({"checkpoint_segments": ((1, 0),)}, ("checkpoint segment (1, 0)", "0 <= first <= last")),
    ({"checkpoint_segments": ((0, 1),), "checkpoint_blocks": (1,)}, ("checkpoint segment (0, 1)", "overlaps")),
    ({"checkpoint_blocks": (-1, 0)}, ("checkpoint_blocks", "non-negative")),
])
def test_knobs_refuse_what_the_flags_cannot_say(fields: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as error:
        Knobs.model_validate({"micro_batch_size": 1, **fields})
    one_line(error, *words)


@pytest.mark.parametrize(("fields", "words"), [
    ({"sharding": "full"}, ("parallel.sharding", "dp_shard > 1")),
    ({"dp_replicate": 2, "dp_shard": 2, "sharding": "optimizer"}, ("parallel.dp_replicate", "HSDP", "ZeRO-2/3")),
    ({"dp_replicate": 2, "dp_shard": 2, "pp": 2}, ("parallel.dp_replicate", "HSDP with pp 2", "is not modelled")),
    ({"dp_shard": 2, "cp": 2, "pp": 2}, ("parallel.cp", "inside pipeline stages", "use cp 1 with pp > 1")),
])
def test_parallel_dims_refuse_layouts_not_modelled(fields: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as error:
        ParallelDims.model_validate(fields)
    one_line(error, *words)


def test_data_parallel_of_refuses_a_stage_that_is_not_zero() -> None:
    with pytest.raises(ValueError) as error:
        ParallelDims.data_parallel_of(8, 4)
    one_line(error, "zero_stage: 4", "use 0, 1, 2 or 3")


def test_a_step_needs_a_micro_batch() -> None:
    """Knobs.grad_accum_steps is a positive integer; the schedule checks it again."""
    with pytest.raises(ValueError) as error:
        accumulation(0)
    one_line(error, "at least one micro-batch", "got 0")


def test_learned_positions_need_max_seq_len() -> None:
    """Validation requires max_seq_len for learned positions; an unvalidated copy reaches the table's rows."""
    gpt2, _ = resolve("tiny-gpt2", seq_len=128, global_batch_size=2)
    assert gpt2.position_rows == gpt2.max_seq_len
    with pytest.raises(ValueError) as error:
        _ = gpt2.model_copy(update={"max_seq_len": None}).position_rows
    one_line(error, "learned position table", "max_seq_len")


# --- model files: config.json fields the fixture files never get wrong ---------------------------

def test_hf_config_refuses_what_is_not_an_object() -> None:
    with pytest.raises(ConfigError) as error:
        model_from_hf_config(["llama"], name="x")  # type: ignore[arg-type]
    one_line(error, "expected a JSON object", "list")


QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 100}


def test_a_moe_config_json_reads_here() -> None:
    assert model_from_hf_config(QWEN2_MOE, name="x").moe is not None  # the two below change one key each


def test_hf_config_refuses_rope_scaling_that_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError) as error:
        model_from_hf_config({**QWEN2_MOE, "rope_scaling": "linear"}, name="x")
    one_line(error, "rope_scaling", "expected a mapping", "'linear'")


def test_qwen2_moe_refuses_a_max_window_layers_that_is_not_an_integer() -> None:
    with pytest.raises(ConfigError) as error:
        model_from_hf_config({**QWEN2_MOE, "use_sliding_window": True, "max_window_layers": "all"}, name="x")
    one_line(error, "max_window_layers", "expected an integer", "'all'")


def test_resolve_refuses_an_empty_model_name() -> None:
    with pytest.raises(ConfigError) as error:
        resolve("  ", seq_len=128, global_batch_size=2)
    one_line(error, "model: empty name", "tiny-llama")


# --- MoE sections: the bundled presets and transformers' configs never combine these -----------

@pytest.mark.parametrize(("fields", "words"), [
    ({"scoring": "topk-softmax", "routed_scaling_factor": 2.5}, ("moe.routed_scaling_factor", "set it to 1")),
    ({"shared_gate": True}, ("moe.shared_gate", "set moe.shared_d_ff")),
    ({"scoring": "sigmoid", "n_experts": 6, "n_group": 6, "topk_group": 1, "top_k": 1, "aux_loss_coef": 0.0},
     ("moe.n_group", "fewer than two per group")),
])
def test_moe_sections_refuse_routers_not_modelled(fields: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as error:
        MoeConfig.model_validate({"n_experts": 8, "top_k": 2, "d_ff_expert": 64, **fields})
    one_line(error, *words)


# --- plan files ----------------------------------------------------------------------------------

def test_plan_files_refuse_what_cannot_be_written_or_read(tmp_path: Path) -> None:
    from roofplan import api

    plan = api.estimate_plan(MODEL, TRAINING, "h100-sxm", Knobs(micro_batch_size=4))
    with pytest.raises(ConfigError) as error:
        plan.save(tmp_path)  # a directory
    one_line(error, "--out: cannot write", str(tmp_path))
    bad = tmp_path / "plan.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ConfigError) as error:
        PlanResult.load(bad)
    one_line(error, f"plan file {bad}", "model")


# --- guards inside the planner: programming errors, not user refusals ----------------------------

def test_a_variant_formula_registers_once() -> None:
    from planner.ops.base import OpKind, OpVariant
    from planner.ops.registry import register_variant

    with pytest.raises(ValueError) as error:
        register_variant(OpKind.CROSS_ENTROPY, OpVariant.CHUNKED_LOSS)(lambda spec, ctx: None)  # type: ignore[arg-type,return-value]
    one_line(error, "cross_entropy/chunked_loss", "already registered", "chunked_loss_cost")
