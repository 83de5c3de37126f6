"""ValidationReport: predicted vs measured, with signed relative errors and a verdict.

This module imports no torch: the report is plain data that the API and CLI pass around.

Tolerances (README "Validate"): peak allocated memory within 3% in ``simulate`` and CPU ``run``
(the live-storage tracker counts the same storages the planner walks), 5% on CUDA (the caching
allocator, cuBLAS workspaces and kernel-internal buffers add what the planner cannot see); step
time within 40% on CPU against a profile calibrated in the same process (eager PyTorch on a few
cores is dominated by dispatch overheads), 15% on CUDA after calibration; FLOPs within 0.5%.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Mode(StrEnum):
    SIMULATE = "simulate"  # fake tensors on CPU: exact bytes and FLOPs, any size, no time
    RUN = "run"  # real steps on a device: memory, time, FLOPs


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"


TOLERANCES: dict[tuple[Mode, str], dict[str, float]] = {
    (Mode.SIMULATE, "cpu"): {"peak_allocated": 0.03, "model_flops": 0.005},
    (Mode.RUN, "cpu"): {"peak_allocated": 0.03, "step_time": 0.40, "model_flops": 0.005},
    (Mode.RUN, "cuda"): {"peak_allocated": 0.05, "step_time": 0.15, "model_flops": 0.005},
}


class Figures(BaseModel):
    """One side of the comparison (None: not measured in this mode)."""

    model_config = ConfigDict(frozen=True)
    peak_allocated_bytes: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    model_flops_per_step: float | None = None
    reserved_bytes: int | None = Field(default=None, description="torch.cuda.max_memory_reserved (CUDA only)")


class RankComparison(BaseModel):
    """One pipeline rank: the planner's peak for it (``best.estimate.stages``) against the peak
    measured running its stages under torch.distributed.pipelining (None: not measured)."""

    model_config = ConfigDict(frozen=True)
    rank: int
    stages: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]  # each stage's (first, last) block
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None
    error: float | None = Field(default=None, description="measured / predicted - 1")
    predicted_at: str = ""  # the planner's op and phase at the peak
    measured_at: str = ""  # torch's action at the peak (F/L/B/I/W<micro-batch>@s<stage>, OPT: optimizer step)
    busiest: bool = False  # the plan's busiest rank (its peak is the plan's)


class ValidationReport(BaseModel):
    """What ``validate`` found for one plan."""

    model_config = ConfigDict(frozen=True)
    model: str
    hardware: str
    knobs: dict[str, object]
    mode: Mode
    device: str  # e.g. "cpu (2 threads)" or "cuda: NVIDIA H200"
    torch_version: str
    steps: int  # measured steps (after warm-up)
    predicted: Figures
    measured: Figures
    errors: dict[str, float] = Field(description="signed relative errors: measured / predicted - 1")
    tolerances: dict[str, float]
    fits: bool  # the step ran without running out of memory (and under the cap where measurable)
    out_of_memory: bool = False
    allocated_at_failure_bytes: int | None = None
    notes: tuple[str, ...] = ()
    verdict: Verdict
    per_rank: tuple[Figures, ...] = Field(default=(), description="each rank's figures (several GPUs)")
    pipeline_ranks: tuple[RankComparison, ...] = Field(default=(), description="each pipeline rank, predicted vs "
                                                       "measured (pipeline-parallel plans)")

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS


def relative_error(measured: float | None, predicted: float | None) -> float | None:
    """measured / predicted - 1 (None when either side is missing)."""
    if measured is None or predicted is None or predicted == 0:
        return None
    return measured / predicted - 1.0


def judge(
    predicted: Figures, measured: Figures, tolerances: dict[str, float], fits: bool,
    ranks: tuple[RankComparison, ...] = (),
) -> tuple[dict[str, float], Verdict, tuple[str, ...]]:
    """Errors for every measured figure, and pass only if it fits and each is within tolerance
    (every measured pipeline rank's peak too)."""
    pairs = {
        "peak_allocated": (measured.peak_allocated_bytes, predicted.peak_allocated_bytes),
        "step_time": (measured.step_time_s, predicted.step_time_s),
        "model_flops": (measured.model_flops_per_step, predicted.model_flops_per_step),
    }
    errors: dict[str, float] = {}
    reasons: list[str] = []
    for key, (m, p) in pairs.items():
        error = relative_error(m, p)
        if error is None:
            continue
        errors[key] = error
        limit = tolerances.get(key)
        if limit is not None and abs(error) > limit:
            reasons.append(f"{key} off by {error:+.1%} (tolerance ±{limit:.0%})")
    limit = tolerances.get("peak_allocated")
    for rank in ranks:
        if rank.error is not None and limit is not None and abs(rank.error) > limit:
            reasons.append(f"pipeline rank {rank.rank}: peak_allocated off by {rank.error:+.1%} "
                           f"(tolerance ±{limit:.0%})")
    if not fits:
        reasons.insert(0, "does not fit: the step ran out of memory")
    return errors, (Verdict.FAIL if reasons else Verdict.PASS), tuple(reasons)
