"""What every config.json reader's tests check, in one place: parameters equal transformers' model
on the meta device and the reference model tensor by tensor, and a planned step equal to what
PyTorch runs (peak within 1% of the live-storage tracker, FLOPs with recompute equal to
FlopCounterMode's)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from hardware.registry import load_hardware
from planner.graph.params import count_params, param_tensors
from planner.model.config import ModelConfig, TrainConfig
from planner.model.families.config_json import model_from_hf_config
from planner.plan.knobs import Knobs
from planner.program.estimate import estimate

HW = load_hardware("h100-sxm")


def hf_count(data: dict[str, Any], fix: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Parameters of transformers' model for ``data`` on the meta device (``fix`` edits a copy of
    the file first, for values transformers' strict config classes refuse)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    data = copy.deepcopy(data)
    if fix is not None:
        fix(data)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**data))
    return sum(p.numel() for p in net.parameters())


def assert_counts_match(data: dict[str, Any], fix: Callable[[dict[str, Any]], None] | None = None) -> ModelConfig:
    """The file read: its parameter count equals transformers' and the reference model's, and the
    planner's tensors are the reference model's, in the same order."""
    torch = pytest.importorskip("torch")
    from validate.reference_model import build_model

    model = model_from_hf_config(data)
    with torch.device("meta"):
        reference = build_model(model)
    assert count_params(model) == hf_count(data, fix) == sum(p.numel() for p in reference.parameters())
    assert list(param_tensors(model)) == [n for n, _ in reference.named_parameters()]
    return model


def assert_matches_pytorch(model: ModelConfig, training: TrainConfig, knobs: Knobs, rel: float = 0.01) -> None:
    """The planned peak within ``rel`` of the tracker over the reference step, and its FLOPs
    (recompute included) equal to FlopCounterMode's."""
    pytest.importorskip("torch")
    from validate.simulate import simulate_step

    predicted = estimate(model, training, HW, knobs)
    measured = simulate_step(model, training, knobs)
    assert predicted.memory.peak_allocated_bytes == pytest.approx(measured.peak_allocated_bytes, rel=rel)
    assert predicted.hardware_flops_per_step == pytest.approx(measured.flops_per_step, rel=1e-9)


def assert_flops_match_transformers(data: dict[str, Any], seq_len: int = 32, batch: int = 2) -> None:
    """The planned model FLOPs of one fp32 step (eager attention) equal FlopCounterMode over
    transformers' own model built from ``data``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from planner.model.sources import resolve
    from validate.flops import transformers_training_flops

    model, training = resolve(data, seq_len=seq_len, global_batch_size=batch, attention="eager")
    planned = estimate(model, training, HW, Knobs(micro_batch_size=batch, precision="fp32")).model_flops_per_step
    assert planned == pytest.approx(transformers_training_flops(data, seq_len, batch), rel=1e-9)
