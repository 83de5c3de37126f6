"""When nothing fits: the ``InfeasibleError`` a search raises, with advice that is measured.

Two ways out are priced, not guessed: the fused optimizer (torch 2.13 runs AdamW's foreach path
unless ``fused=True`` is passed, and foreach holds a parameter-sized temporary during the step
that fused does not: ``planner.plan.optimizer``), and more GPUs (``search.scaling.fewest_gpus``).
The optimizer implementation is not a search dimension: fused is the same update as foreach and
never needs more memory or time here, so searching it would only ever pick it, silently moving
every plan off torch's default; the advice names it, with its measured footprint, when it is what
makes a plan fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hardware.profile import HardwareProfile
from planner.errors import InfeasibleError
from planner.model.config import ModelConfig, OptimizerImpl, TrainConfig
from planner.plan.checkpointing import TORCHTITAN_SAVE_LIST, CheckpointPolicy, SaveList
from planner.plan.knobs import GradSync
from planner.plan.layouts import as_flags
from planner.plan.optimizer import optimizer_spec
from planner.plan.parallel_dims import layout_label
from planner.plan.pipeline_schedules import PipelineSchedule
from planner.precision import PrecisionPolicy
from planner.program.estimate import estimate
from planner.program.results import PlanResult
from roofplan.advice import FusedFit, infeasible_message, reserve_exceeds_cap
from roofplan.finetune_advice import finetune_advice

if TYPE_CHECKING:  # search imports optuna: only when a search runs
    from search.space import SearchSpace

Progress = Callable[[int, int], None]


def infeasible_error(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap: int, space: SearchSpace,
                     closest: PlanResult, headroom: int, scale: dict[str, object],
                     on_stage: Callable[[str], None] | None = None,
                     on_progress: Progress | None = None) -> InfeasibleError:
    """The error for a search where nothing fits in ``cap`` (the cap less ``headroom``): the
    smallest plan ``closest``, whether the fused optimizer makes a plan fit, and the fewest GPUs
    that would hold one (``scale``: ``fewest_gpus``'s keyword arguments beyond the workload)."""
    stage = on_stage or (lambda _text: None)
    if reserve_exceeds_cap(hw, cap) is not None:  # no optimizer and no number of GPUs can help
        return InfeasibleError(infeasible_message(hw.name, cap, closest.best, None, headroom), closest=closest)
    fused = None
    if fused_helps(training):
        stage("nothing fits: pricing the fused optimizer")
        fused = fused_fit(model, training, hw, cap, space, closest, on_progress)
    advice = None
    if model.finetune is not None:
        advice = "not priced for a fine-tuning plan (adapters are planned on one GPU)"
    elif fused is None or not fused.fits:  # the fused optimizer fits it: no more GPUs needed
        stage("nothing fits: finding the fewest GPUs that would hold it")
        advice = scale_out(model, training, hw, cap, on_progress=on_progress, **scale)  # type: ignore[arg-type]
    message = infeasible_message(hw.name, cap, closest.best, advice, headroom, fused=fused)
    tuned = finetune_advice(model, training, hw, cap, closest.best.knobs)  # roofplan.finetune_advice
    return InfeasibleError(message + (f"\n  {tuned}" if tuned else ""), closest=closest)


def fused_helps(training: TrainConfig) -> bool:
    """Whether the fused implementation of the training's optimizer holds less than its own (AdamW
    foreach's parameter-sized step temporary; SGD's implementations hold the same)."""
    ours = optimizer_spec(training.optimizer, training.optimizer_impl)
    fused = optimizer_spec(training.optimizer, OptimizerImpl.FUSED)
    return fused.step_temporaries_per_param < ours.step_temporaries_per_param


def fused_fit(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap: int, space: SearchSpace,
              closest: PlanResult, on_progress: Progress | None = None) -> FusedFit:
    """The smallest plan priced again with ``--optimizer-impl fused``; when that still does not
    fit, the first plan of the space that fits with it (exact: ``search.smallest.first_fitting``)."""
    from search.smallest import first_fitting

    fused = training.model_copy(update={"optimizer_impl": OptimizerImpl.FUSED})
    knobs = closest.best.knobs
    need = estimate(model, fused, hw, knobs, cap).memory.device_bytes
    if need <= cap:
        return FusedFit(knobs=knobs, device_bytes=need, fits=True)
    found = first_fitting(model, fused, hw, space, cap, on_progress=on_progress)
    if found is not None:
        return FusedFit(knobs=found.knobs, device_bytes=found.device_bytes, fits=True)
    return FusedFit(knobs=knobs, device_bytes=need, fits=False)


def scale_out(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap: int,
              precisions: tuple[PrecisionPolicy, ...], gpus: int,
              grad_sync: GradSync = GradSync.EVERY, allow_segments: bool = True,
              checkpoint_policy: CheckpointPolicy | None = None,
              save: SaveList = TORCHTITAN_SAVE_LIST, on_progress: Progress | None = None,
              pipeline: tuple[int, PipelineSchedule | None, int | None] | None = None) -> str | None:
    """"N GPUs with ZeRO-s would hold it" for the fewest N above ``gpus``, or None (the user's
    checkpoint policy kept, and named in the command); ``on_progress(tried, counts)`` follows the
    GPU counts tried."""
    from search.scaling import fewest_gpus

    found = fewest_gpus(model, training, hw, cap, precisions, start=gpus, fsdp_grad_sync=grad_sync,
                        allow_segments=allow_segments, checkpoint_policy=checkpoint_policy, save_list=save,
                        on_progress=on_progress, pipeline=pipeline)
    if found is None:
        return None
    n, knobs = found
    flag = " --fsdp-grad-sync last" if knobs.fsdp_grad_sync is GradSync.LAST else ""
    if knobs.parallel.pp > 1:
        flag += f" --pp-schedule {knobs.pp_schedule.value}"
    policy = f" --checkpoint-policy {checkpoint_policy.value}" if checkpoint_policy is not None else ""
    return (f"it fits on {n} GPUs as {layout_label(knobs.parallel)} ({knobs.precision.value}, micro-batch "
            f"{knobs.micro_batch_size}): {as_flags(knobs.parallel)}{policy}{flag}")
