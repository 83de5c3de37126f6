"""The typed results a plan produces: frozen pydantic models that dump to JSON and load back.

A plan file (``plan --out plan.json``) is a ``PlanResult`` dumped as JSON: it holds the model,
the training workload, the hardware profile, the chosen knobs and the predicted figures, so
``validate`` can re-run exactly what was planned.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from hardware.files import read_text_file
from hardware.profile import HardwareProfile
from hardware.validation import describe_validation_error
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.parallel.collectives import ParallelConfig
from planner.plan.knobs import Knobs
from planner.program.estimate import Estimate, device_bytes


class ModelSummary(BaseModel):
    """The model as planned: its name, size and full config (for re-running the plan)."""

    model_config = ConfigDict(frozen=True)
    name: str
    family: str
    n_params: int
    config: ModelConfig
    n_trainable_params: int | None = None  # a fine-tuning plan's adapters (None: every parameter trains)


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
    hbm_cap_bytes: int = Field(description="the memory cap per GPU (--hbm, or the device's memory)")
    headroom_bytes: int = Field(default=0, ge=0, description="bytes of the cap kept free (--headroom): every plan "
                                "fits in hbm_cap_bytes - headroom_bytes, its estimates' memory.hbm_cap_bytes")
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

    @computed_field  # type: ignore[prop-decorator]
    @property
    def margin_bytes(self) -> int:
        """What the chosen plan leaves free of the cap per GPU (negative: by how much it does not fit)."""
        return self.hbm_cap_bytes - self.best.estimate.memory.device_bytes

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
        text = read_text_file(source, f"plan file {source}", "a plan file written by `plan --out`")
        try:
            plan = cls.model_validate_json(text)
        except ValidationError as error:
            raise ConfigError(describe_validation_error(error, f"plan file {source}")) from None
        plan.check_consistent(f"plan file {source}")
        return plan

    def inconsistencies(self) -> tuple[str, ...]:
        """Fields that contradict each other (a hand-edited plan file): one phrase per problem,
        naming the fields. A plan ``plan`` wrote has none."""
        problems = []
        if self.parallel.gpus_per_node != self.hardware.gpus_per_node:
            problems.append(f"parallel.gpus_per_node {self.parallel.gpus_per_node} != hardware.gpus_per_node "
                            f"{self.hardware.gpus_per_node}")
        problems.extend(f"best.{problem}" for problem in self._entry_inconsistencies(self.best))
        others = [i for i, entry in enumerate(self.alternatives) if self._entry_inconsistencies(entry)]
        if others and problems:  # the same edit, seen again in each alternative: named once
            problems.append(f"alternatives {', '.join(map(str, others))} likewise")
        elif others:
            problems.extend(f"alternatives.{i}.{p}" for i in others for p in self._entry_inconsistencies(self.alternatives[i]))
        return tuple(problems)

    def _entry_inconsistencies(self, entry: PlanEntry) -> list[str]:
        """What one configuration's knobs and figures contradict in the plan (and each other)."""
        knobs, est, training = entry.knobs, entry.estimate, self.training
        mem = est.memory
        problems = []
        if knobs.sequences_per_step != training.global_batch_size:
            problems.append(
                f"knobs: micro_batch_size {knobs.micro_batch_size} x grad_accum_steps {knobs.grad_accum_steps} x "
                f"{knobs.data_parallel} data-parallel rank{'s' if knobs.data_parallel > 1 else ''} = "
                f"{knobs.sequences_per_step} sequences per step, but "
                f"training.global_batch_size is {training.global_batch_size}")
        if knobs.parallel.world_size != self.parallel.world_size:
            problems.append(f"knobs.parallel: its degrees make {knobs.parallel.world_size} GPUs, but "
                            f"parallel.world_size is {self.parallel.world_size}")
        if est.hardware != self.hardware.name:
            problems.append(f"estimate.hardware {est.hardware!r} is not hardware.name {self.hardware.name!r}")
        if mem.hbm_cap_bytes != self.hbm_cap_bytes - self.headroom_bytes:
            problems.append(f"estimate.memory.hbm_cap_bytes {mem.hbm_cap_bytes} != hbm_cap_bytes {self.hbm_cap_bytes}"
                            f" - headroom_bytes {self.headroom_bytes}")
        if mem.fits != (mem.device_bytes <= mem.hbm_cap_bytes):
            problems.append(f"estimate.memory.fits {str(mem.fits).lower()} contradicts device_bytes "
                            f"{mem.device_bytes} vs hbm_cap_bytes {mem.hbm_cap_bytes}")
        if sum(mem.at_peak.values()) != mem.peak_allocated_bytes:
            problems.append(f"estimate.memory.at_peak sums to {sum(mem.at_peak.values())}, not "
                            f"peak_allocated_bytes {mem.peak_allocated_bytes}")
        if mem.device_bytes != device_bytes(mem.peak_allocated_bytes, self.hardware):
            problems.append(f"estimate.memory.device_bytes {mem.device_bytes} is not peak_allocated_bytes x "
                            f"hardware.fragmentation_factor + runtime_reserve_bytes "
                            f"({device_bytes(mem.peak_allocated_bytes, self.hardware)})")
        if not math.isclose(est.tokens_per_s * est.step_time_s, training.tokens_per_step, rel_tol=1e-9):
            problems.append(f"estimate.tokens_per_s x step_time_s = {est.tokens_per_s * est.step_time_s:.0f} tokens, "
                            f"not training.seq_len x global_batch_size = {training.tokens_per_step}")
        return problems

    def check_consistent(self, context: str = "plan") -> None:
        """Refuse a plan whose fields contradict each other, in one line naming them."""
        problems = self.inconsistencies()
        if problems:
            raise ConfigError(f"{context}: inconsistent fields: {'; '.join(problems)}; re-plan it with plan --out "
                              "instead of editing derived fields")
