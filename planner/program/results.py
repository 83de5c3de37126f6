"""The typed results a plan produces: frozen pydantic models that dump to JSON and load back.

A plan file (``plan --out plan.json``) is a ``PlanResult`` dumped as JSON: it holds the model,
the training workload, the hardware profile, the chosen knobs and the predicted figures, so
``validate`` can re-run exactly what was planned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hardware.profile import HardwareProfile
from hardware.validation import describe_validation_error
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.parallel.collectives import ParallelConfig
from planner.plan.knobs import Knobs
from planner.program.estimate import Estimate


class ModelSummary(BaseModel):
    """The model as planned: its name, size and full config (for re-running the plan)."""

    model_config = ConfigDict(frozen=True)
    name: str
    family: str
    n_params: int
    config: ModelConfig


class PlanEntry(BaseModel):
    """One configuration and its predicted figures."""

    model_config = ConfigDict(frozen=True)
    knobs: Knobs
    estimate: Estimate


class ParetoPoint(BaseModel):
    """A non-dominated plan: no other feasible plan is both faster and smaller."""

    model_config = ConfigDict(frozen=True)
    step_time_s: float
    device_bytes: int
    knobs: Knobs


class SearchStats(BaseModel):
    model_config = ConfigDict(frozen=True)
    sampler: str
    n_trials: int  # trials in the study (all workers, when the study is shared)
    n_feasible: int  # of those, how many fit under the cap
    n_evaluated: int  # distinct configurations this process priced
    wall_s: float
    study_name: str | None = None
    storage: str | None = None


class PlanResult(BaseModel):
    """What ``plan`` answers: the model, workload, hardware and the chosen configuration."""

    model_config = ConfigDict(frozen=True)
    model: ModelSummary
    training: TrainConfig
    hardware: HardwareProfile
    hbm_cap_bytes: int
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="GPUs and GPUs per node")
    best: PlanEntry
    alternatives: tuple[PlanEntry, ...] = Field(default=(), description="the next fastest plans that fit")
    pareto: tuple[ParetoPoint, ...] = Field(default=(), description="step time vs device memory, non-dominated")
    search: SearchStats | None = None

    @model_validator(mode="before")
    @classmethod
    def _node_from_parallel(cls, data: Any) -> Any:
        """Plan files written before profiles carried ``gpus_per_node`` name the node only under
        ``parallel``: the hardware takes it from there (one topology per plan)."""
        if isinstance(data, dict) and isinstance(data.get("hardware"), dict) and isinstance(data.get("parallel"), dict):
            per_node = data["parallel"].get("gpus_per_node")
            if per_node is not None and "gpus_per_node" not in data["hardware"]:
                data = {**data, "hardware": {**data["hardware"], "gpus_per_node": per_node}}
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    def save(self, path: str | Path) -> Path:
        """Write the plan file ``validate`` reads."""
        target = Path(path)
        try:
            target.write_text(self.to_json())
        except OSError as error:
            raise ConfigError(f"--out: cannot write {target}: {error.strerror or error}") from None
        return target

    @classmethod
    def load(cls, path: str | Path) -> PlanResult:
        """Read a plan file written by ``plan --out`` or ``save``; errors name the field."""
        source = Path(path)
        try:
            text = source.read_text()
        except OSError as error:
            raise ConfigError(f"plan file {source}: cannot read it ({error.strerror or error})") from None
        try:
            return cls.model_validate_json(text)
        except ValidationError as error:
            raise ConfigError(describe_validation_error(error, f"plan file {source}")) from None
