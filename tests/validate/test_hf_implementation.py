"""``implementation: hf`` against transformers' own models (5.24.0) under the live-storage tracker.

Each case builds the transformers model of a fixture config.json (GPT-2 with ``gelu_new`` and
with ``gelu_pytorch_tanh``, Llama, Mistral, Qwen2), runs the plan's steady-state step under fake
tensors as a GPU would run it (``validate.implementations.as_a_gpu_runs_it``) and compares the
peak with the planner priced for transformers' code. Required: within 1% (issue: part b).
Measured when written: within 0.16% in every case here (fp32, bf16-mixed, bf16-true; no
checkpointing and every layer checkpointed; SDPA and eager attention; dropout; accumulation).
The reference pricing of the same models misses by up to 18% (gelu_new) and 3% (bf16-true
RMSNorm), which ``test_reference_pricing_misses_transformers`` keeps visible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from hardware.errors import ConfigError  # noqa: E402
from hardware.registry import load_hardware  # noqa: E402
from planner.model.config import ModelConfig, TrainConfig  # noqa: E402
from planner.model.sources import model_from_hf_config  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.program.estimate import estimate  # noqa: E402
from validate.hf_model import checkpoint_every, simulate_hf  # noqa: E402

HW = load_hardware("h100-sxm")
FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf"
TOLERANCE = 0.01
SEQ, MICRO = 128, 2

# (family, config.json changes, ModelConfig changes)
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gpt2-gelu_new": ("gpt2", {}, {"dropout": 0.0}),
    "gpt2-gelu_pytorch_tanh": ("gpt2", {"activation_function": "gelu_pytorch_tanh"}, {"dropout": 0.0}),
    "llama": ("llama", {}, {}),
    "mistral": ("mistral", {}, {}),
    "qwen2": ("qwen2", {}, {}),
}
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")


def hf_model_config(name: str, implementation: str = "hf", **changes: Any) -> ModelConfig:
    family, file_changes, model_changes = MODELS[name]
    data = {**json.loads((FIXTURES / f"{family}.json").read_text()), **file_changes}
    model = model_from_hf_config(data, name=name)
    return ModelConfig.model_validate({**model.model_dump(), "max_seq_len": max(SEQ, model.max_seq_len or 0),
                                       **model_changes, "implementation": implementation, **changes})


def compare(model: ModelConfig, precision: str, checkpoint: bool, accumulation: int = 1,
            flops: bool = False) -> tuple[int, int, Any]:
    """(predicted, measured peak, the simulated step)."""
    training = TrainConfig(seq_len=SEQ, global_batch_size=MICRO * accumulation)
    knobs = Knobs(micro_batch_size=MICRO, grad_accum_steps=accumulation, precision=precision,
                  checkpoint_blocks=tuple(range(model.n_layers)) if checkpoint else ())
    est = estimate(model, training, HW, knobs)
    step, _ = simulate_hf(model, training, knobs, est.n_params, checkpoint_every(knobs, model.n_layers), flops=flops)
    return est.memory.peak_allocated_bytes, step.peak_allocated_bytes, (est, step)


# Every model in every precision; checkpointing alternates between them, so each model and each
# precision runs both with and without it (pairwise: 15 cases where the full 5 x 3 x 2 product took 30)
PEAK_CASES = [pytest.param(name, precision, bool((i + j) % 2), id=f"{name}-{precision}-{('no-ckpt', 'ckpt')[(i + j) % 2]}")
              for i, name in enumerate(MODELS) for j, precision in enumerate(PRECISIONS)]


@pytest.mark.parametrize(("name", "precision", "checkpoint"), PEAK_CASES)
def test_peak_matches_transformers(name: str, precision: str, checkpoint: bool) -> None:
    predicted, measured, _ = compare(hf_model_config(name), precision, checkpoint)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.parametrize(("name", "precision"), [("gpt2-gelu_new", "bf16-mixed"), ("llama", "bf16-true"),
                                                 ("qwen2", "fp32")])
def test_eager_attention_matches_transformers(name: str, precision: str) -> None:
    """attn_implementation eager: transformers' float mask added, Llama's fp32 softmax."""
    for checkpoint in (False, True):
        predicted, measured, _ = compare(hf_model_config(name, attention="eager"), precision, checkpoint)
        assert predicted == pytest.approx(measured, rel=TOLERANCE), checkpoint


def test_dropout_and_accumulation_match_transformers() -> None:
    """GPT-2's dropouts (bool masks as on CUDA; none inside SDPA), two micro-batches, tied and
    untied (tied: the LM head's gradient waits in autograd's input buffer for the embedding's)."""
    for tied, precision, checkpoint in ((False, "bf16-mixed", True), (False, "fp32", False),
                                        (True, "bf16-mixed", False), (True, "fp32", True)):
        model = hf_model_config("gpt2-gelu_new", dropout=0.1, tie_embeddings=tied)
        predicted, measured, _ = compare(model, precision, checkpoint, accumulation=2)
        assert predicted == pytest.approx(measured, rel=TOLERANCE), (tied, precision, checkpoint)


def test_flops_equal_flop_counter_on_transformers() -> None:
    """Hardware FLOPs (recomputation included) as FlopCounterMode counts transformers' step."""
    for name, checkpoint in (("gpt2-gelu_new", True), ("llama", False)):
        _, _, (est, step) = compare(hf_model_config(name), "bf16-mixed", checkpoint, flops=True)
        assert est.hardware_flops_per_step == pytest.approx(step.flops_per_step, rel=0.005), name


def test_reference_pricing_misses_transformers() -> None:
    """Why the setting exists: priced as the reference model, transformers' GPT-2 (gelu_new)
    and Llama in bf16-true read well under what they allocate."""
    for name, precision, under in (("gpt2-gelu_new", "fp32", 0.10), ("llama", "bf16-true", 0.02)):
        hf = hf_model_config(name)
        predicted, measured, _ = compare(hf, precision, False)
        assert predicted == pytest.approx(measured, rel=TOLERANCE)
        reference = estimate(hf_model_config(name, implementation="reference"), TrainConfig(seq_len=SEQ, global_batch_size=MICRO),
                             HW, Knobs(micro_batch_size=MICRO, precision=precision)).memory.peak_allocated_bytes
        assert reference < measured * (1 - under), name


def test_checkpoint_placements_transformers_can_run() -> None:
    assert checkpoint_every(Knobs(micro_batch_size=1), 4) is None
    assert checkpoint_every(Knobs(micro_batch_size=1, checkpoint_blocks=(0, 1, 2, 3)), 4) == 1
    assert checkpoint_every(Knobs(micro_batch_size=1, checkpoint_blocks=(0, 2)), 4) == 2
    with pytest.raises(ConfigError, match="every_n_layers") as error:
        checkpoint_every(Knobs(micro_batch_size=1, checkpoint_blocks=(2, 3)), 4)
    assert "\n" not in str(error.value)
