"""``validate(plan)``: the one entry point the façade, the CLI and ``plan --validate`` call."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hardware.errors import ConfigError
from hardware.registry import load_hardware
from planner.model.config import Implementation, LossKind, effective_loss
from planner.program.results import PlanResult
from validate.lora import simulate_lora
from validate.report import ValidationReport
from validate.run import run, simulate
from validate.simulate import Progress

if TYPE_CHECKING:
    from validate.memory_record import MemoryRecorder

RECORDED = "--memory-snapshot, --trace and --compare"


class RequestedMode(StrEnum):
    """What the caller asks for; ``auto`` resolves to ``run`` or ``simulate`` (the report's Mode)."""

    AUTO = "auto"
    SIMULATE = "simulate"
    RUN = "run"


def validate(
    plan: PlanResult | str | Path,
    mode: str = "auto",
    device: str | None = None,
    steps: int = 5,
    hardware: str | Path | None = None,
    progress: Progress | None = None,
    implementation: str | None = None,
    recorder: MemoryRecorder | None = None,
) -> ValidationReport:
    """Measure ``plan`` (a PlanResult or a plan file): ``simulate`` (fake tensors), ``run`` on a
    device, or ``auto`` (run on CUDA when available, else simulate). ``progress`` is called with
    a short description of each stage as it starts. ``implementation`` (default: the plan's)
    picks whose model runs: the reference model, or transformers' (``hf``, validate.hf_model).
    ``recorder`` (``validate.memory_record.MemoryRecorder``) records the measured step's
    allocations: one-GPU plans of the reference model (``check_recordable``)."""
    if not isinstance(plan, PlanResult):
        plan = PlanResult.load(plan)  # refuses a file whose fields contradict each other
    else:
        plan.check_consistent()
    try:
        requested = RequestedMode(mode)
    except ValueError:
        raise ConfigError(f"--mode: {mode!r} is not a mode; use auto, simulate or run") from None
    if plan.model.config.finetune is not None:  # peft cannot inject adapters under fake tensors (validate.lora)
        if (requested is RequestedMode.RUN or device == "cuda" or recorder is not None
                or implementation not in (None, Implementation.REFERENCE.value)
                or plan.model.config.implementation is not Implementation.REFERENCE):
            raise ConfigError("validate: a LoRA plan is measured with --mode simulate (peft's adapters on the reference "
                              "model, real CPU tensors); --mode run, --device cuda, --implementation hf and the "
                              "recorded files are not wired for it yet")
        return simulate_lora(plan)
    impl = _implementation(plan, implementation)
    if recorder is not None:
        check_recordable(plan, impl)
    if plan.best.knobs.parallel.pp > 1:
        return _validate_pipeline(plan, impl, requested, device, progress)
    if impl is not Implementation.REFERENCE:
        return _validate_implementation(plan, impl, requested, device, steps, hardware, progress)
    if plan.model.config.implementation is not Implementation.REFERENCE:
        from validate.hf_model import repriced

        plan = repriced(plan, impl)  # the reference model runs it: priced for the reference
    if plan.best.knobs.parallel.world_size > 1:
        return _validate_several_ranks(plan, requested, device, steps, hardware, progress)
    if requested is RequestedMode.AUTO:
        requested = RequestedMode.RUN if torch.cuda.is_available() else RequestedMode.SIMULATE
    if requested is RequestedMode.SIMULATE:
        if device == "cuda":
            raise ConfigError("--device: simulate runs on the CPU under fake tensors; drop --device or use --mode run")
        return simulate(plan, progress, recorder)
    profile = load_hardware(hardware) if hardware is not None else None
    return run(plan, device=device or "cuda", steps=steps, profile=profile, progress=progress, recorder=recorder)


def auto_runs_on_a_gpu() -> bool:
    """Whether ``--mode auto`` runs the plan on a GPU here (it does when torch sees CUDA)."""
    return bool(torch.cuda.is_available())


def check_recordable(plan: PlanResult, impl: Implementation) -> None:
    """What the recorded files cover: one GPU, the reference model, priced for it (else one line)."""
    gpus = plan.best.knobs.parallel.world_size
    if gpus > 1:
        raise ConfigError(f"{RECORDED}: recorded for one-GPU plans; this plan uses {gpus} GPUs (validate it "
                          "without them, or plan --memory-snapshot/--trace for its prediction)")
    if impl is not Implementation.REFERENCE or plan.model.config.implementation is not Implementation.REFERENCE:
        raise ConfigError(f"{RECORDED}: recorded for the reference model priced for it; this plan is priced for "
                          f"{plan.model.config.implementation.value} and runs {impl.value} (plan with "
                          "--implementation reference, and validate without --implementation hf)")


def _validate_pipeline(plan: PlanResult, impl: Implementation, mode: RequestedMode, device: str | None,
                       progress: Progress | None) -> ValidationReport:
    """A pipeline-parallel plan: every pipeline rank simulated (``validate.pipeline_validate``)."""
    from validate.distributed import launched_by_torchrun
    from validate.pipeline_validate import check_runnable, refuse_run, simulate_pipeline

    if impl is not Implementation.REFERENCE:
        raise ConfigError(f"--implementation: {impl.value} is not run under a pipeline; the reference model is split "
                          "into the plan's stages: use --implementation reference")
    if plan.model.config.implementation is not Implementation.REFERENCE:
        from validate.hf_model import repriced

        plan = repriced(plan, impl)  # the reference model runs it: priced for the reference
    check_runnable(plan)
    if mode is RequestedMode.RUN or (mode is RequestedMode.AUTO and launched_by_torchrun()):
        refuse_run(plan)
    if device == "cuda":
        raise ConfigError("--device: a pipeline plan is simulated on the CPU under fake tensors; drop --device")
    return simulate_pipeline(plan, progress)


def _implementation(plan: PlanResult, requested: str | None) -> Implementation:
    """The implementation to run; the reference refuses plans priced with another loss."""
    try:
        impl = Implementation(requested) if requested is not None else plan.model.config.implementation
    except ValueError:
        raise ConfigError(f"--implementation: {requested!r} is not one; use reference or hf") from None
    if impl is Implementation.REFERENCE and effective_loss(plan.model.config) is not LossKind.PLAIN:
        raise ConfigError(f"validate: the reference model runs the plain loss, not {effective_loss(plan.model.config).value}; "
                          "plan with loss: plain to validate it")
    return impl


def _validate_implementation(plan: PlanResult, impl: Implementation, mode: RequestedMode, device: str | None,
                             steps: int, hardware: str | Path | None, progress: Progress | None) -> ValidationReport:
    if impl is Implementation.TORCHTITAN:
        raise ConfigError("--implementation: torchtitan is priced from its 0.3.0 sources but validate cannot run it "
                          "(it needs triton and a GPU build); validate --implementation hf or reference")
    from validate.hf_model import validate_hf
    from validate.report import Mode

    if mode is RequestedMode.AUTO:
        mode = RequestedMode.RUN if torch.cuda.is_available() else RequestedMode.SIMULATE
    if mode is RequestedMode.SIMULATE and device == "cuda":
        raise ConfigError("--device: simulate runs on the CPU under fake tensors; drop --device or use --mode run")
    profile = load_hardware(hardware) if hardware is not None else None
    return validate_hf(plan, Mode(mode.value), device, steps, profile, progress)


def _validate_several_ranks(plan: PlanResult, mode: RequestedMode, device: str | None, steps: int,
                            hardware: str | Path | None, progress: Progress | None = None) -> ValidationReport:
    from validate.distributed import launched_by_torchrun, run_rank, simulate_rank

    gpus = plan.best.knobs.parallel.world_size
    if mode is RequestedMode.AUTO:
        mode = RequestedMode.RUN if launched_by_torchrun() else RequestedMode.SIMULATE
    if mode is RequestedMode.SIMULATE:
        return simulate_rank(plan, progress)
    if not launched_by_torchrun():
        raise ConfigError(f"--mode run: this plan uses {gpus} GPUs; launch it with torchrun --nproc-per-node {gpus} "
                          "-m roofplan validate PLAN.json --mode run (or --mode simulate for one rank in this process)")
    profile = load_hardware(hardware) if hardware is not None else None
    report = run_rank(plan, device or "cuda", steps, profile)
    if report is None:  # ranks other than 0 print nothing
        raise _QuietExit
    return report


class _QuietExit(ConfigError):
    """A non-zero rank of a torchrun validation: rank 0 reports."""

    exit_code = 0
