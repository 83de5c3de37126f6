"""``validate(plan)``: the one entry point the façade, the CLI and ``plan --validate`` call."""

from __future__ import annotations

from pathlib import Path

import torch

from hardware.errors import ConfigError
from hardware.registry import load_hardware
from planner.results import PlanResult
from validate.report import ValidationReport
from validate.run import run, simulate


def validate(
    plan: PlanResult | str | Path,
    mode: str = "auto",
    device: str | None = None,
    steps: int = 5,
    hardware: str | Path | None = None,
) -> ValidationReport:
    """Measure ``plan`` (a PlanResult or a plan file): ``simulate`` (fake tensors), ``run`` on a
    device, or ``auto`` (run on CUDA when available, else simulate)."""
    if not isinstance(plan, PlanResult):
        plan = PlanResult.load(plan)
    if plan.best.knobs.data_parallel > 1:
        raise ConfigError(
            f"validate: this plan uses {plan.best.knobs.data_parallel} GPUs; multi-GPU validation (torchrun with DDP "
            "or FSDP2, or a fake process group in simulate) is not available yet"
        )
    if mode not in ("auto", "simulate", "run"):
        raise ConfigError(f"--mode: {mode!r} is not a mode; use auto, simulate or run")
    if mode == "auto":
        mode = "run" if torch.cuda.is_available() else "simulate"
    if mode == "simulate":
        if device == "cuda":
            raise ConfigError("--device: simulate runs on the CPU under fake tensors; drop --device or use --mode run")
        return simulate(plan)
    profile = load_hardware(hardware) if hardware is not None else None
    return run(plan, device=device or "cuda", steps=steps, profile=profile)
