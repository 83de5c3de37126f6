"""The Python API: everything the CLI does, as plain calls returning frozen, JSON-ready models.

    from planner import api
    model, training = api.load_model("llama3-8b", seq_len=4096)
    result = api.estimate_plan(model, training, "h100-sxm", api.Knobs(micro_batch_size=1, grad_accum_steps=512))
    print(result.best.estimate.memory.peak_allocated_bytes)

Importing this module does not import torch or optuna; ``search`` and ``validate`` are imported
lazily by the calls that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hardware.profile import HardwareProfile
from hardware.registry import load_hardware
from hardware.units import parse_bytes
from hardware.validation import describe_validation_error
from planner.config import ModelConfig, OptimizerImpl, OptimizerKind, TrainConfig
from planner.errors import ConfigError
from planner.estimate import estimate
from planner.knobs import Knobs, parse_checkpoint_spec
from planner.model_io import Workload, resolve
from planner.params import count_params
from planner.results import ModelSummary, ParetoPoint, PlanEntry, PlanResult, SearchStats


def load_model(
    source: str | Path | dict[str, Any] | ModelConfig | Workload,
    *,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    attention: str | None = None,
    dropout: float | None = None,
    optimizer: str | None = None,
    optimizer_impl: str | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    """Model and training workload from a preset name, a YAML/JSON path, a dict or a config."""
    model, training = resolve(
        source, seq_len=seq_len, global_batch_size=global_batch_size, attention=attention, dropout=dropout
    )
    updates = {k: v for k, v in (("optimizer", optimizer), ("optimizer_impl", optimizer_impl)) if v is not None}
    if updates:
        try:
            training = TrainConfig.model_validate({**training.model_dump(), **updates})
        except ValidationError as error:
            raise ConfigError(describe_validation_error(error, "training")) from None
    return model, training


def hbm_cap(hardware: HardwareProfile, hbm: str | int | None) -> int:
    """The memory cap: ``--hbm`` if given (``80GB``, ``80GiB``, bytes), else the device's HBM."""
    return hardware.hbm_bytes if hbm is None else parse_bytes(hbm, "--hbm")


def summarize_model(model: ModelConfig) -> ModelSummary:
    return ModelSummary(name=model.name, family=model.family.value, n_params=count_params(model), config=model)


def estimate_plan(
    model: ModelConfig,
    training: TrainConfig,
    hardware: str | Path | HardwareProfile | None,
    knobs: Knobs,
    hbm: str | int | None = None,
) -> PlanResult:
    """The estimate of one fully fixed configuration, wrapped as a plan result."""
    hw = load_hardware(hardware)
    cap = hbm_cap(hw, hbm)
    result = estimate(model, training, hw, knobs, hbm_cap_bytes=cap)
    return PlanResult(
        model=summarize_model(model),
        training=training,
        hardware=hw,
        hbm_cap_bytes=cap,
        best=PlanEntry(knobs=knobs, estimate=result),
    )


__all__ = [
    "ConfigError",
    "Knobs",
    "ModelSummary",
    "OptimizerImpl",
    "OptimizerKind",
    "ParetoPoint",
    "PlanEntry",
    "PlanResult",
    "SearchStats",
    "estimate_plan",
    "hbm_cap",
    "load_hardware",
    "load_model",
    "parse_checkpoint_spec",
    "summarize_model",
]
