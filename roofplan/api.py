"""The Python API: everything the CLI does, as plain calls returning frozen, JSON-ready models.

    from roofplan import api
    model, training = api.load_model("llama3-8b", seq_len=4096)
    result = api.estimate_plan(model, training, "h100-sxm", api.Knobs(micro_batch_size=1, grad_accum_steps=512))
    print(result.best.estimate.memory.peak_allocated_bytes)

Importing this module does not import torch or optuna; ``search`` and ``validate`` are imported
lazily by the calls that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from hardware.profile import HardwareProfile
from hardware.registry import load_hardware
from hardware.stack import parse_stack
from hardware.validation import describe_validation_error
from planner.errors import ConfigError, ConfigWarning, InfeasibleError
from planner.graph.params import count_params, count_trainable_params
from planner.model.config import ModelConfig, OptimizerImpl, OptimizerKind, TrainConfig
from planner.model.sources import Workload, resolve
from planner.parallel.collectives import ParallelConfig
from planner.plan.checkpointing import CheckpointPolicy, SaveList, parse_save_list
from planner.plan.knobs import GradSync, Knobs, parse_checkpoint_spec
from planner.plan.layouts import (
    LayoutRequest,
    check_fixed_request,
    checked_request,
    fixed_layout,
    pipeline_degrees,
    replicate_degrees,
)
from planner.plan.pipeline_schedules import PipelineSchedule
from planner.precision import PrecisionPolicy
from planner.program.estimate import estimate
from planner.program.results import ModelSummary, ParetoPoint, PlanEntry, PlanResult, SearchStats
from roofplan.infeasible import infeasible_error
from roofplan.memory_cap import hbm_cap, headroom_bytes
from roofplan.pipeline_flags import PipelineRequest, pipeline_request
from roofplan.plan_flags import (
    check_finetune_gpus,
    checkpoint_blocks_flag,
    checkpoint_policy_flag,
    finetune_flags,
    grad_sync_flag,
    precisions_flag,
)
from roofplan.results import Plan

if TYPE_CHECKING:  # search imports optuna: only when a search runs
    from search.study import SearchOptions


def load_model(
    source: str | Path | dict[str, Any] | ModelConfig | Workload,
    *,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    attention: str | None = None,
    dropout: float | None = None,
    optimizer: str | None = None,
    optimizer_impl: str | None = None,
    implementation: str | None = None,
    stack: str | None = None,
    finetune: str | None = None,
    lora_rank: int | None = None,
    lora_targets: str | Sequence[str] | None = None,
    lora_alpha: float | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    """Model and training workload from a preset name, a YAML/JSON path, a dict or a config;
    ``implementation`` (reference, hf, torchtitan) and ``stack`` (the software stack: pytorch,
    torchtitan, torchtitan-compile, llm-foundry, megatron) override the model file's; ``finetune``
    (lora), ``lora_rank``, ``lora_targets`` and ``lora_alpha`` override its ``finetune:`` section
    (``roofplan.plan_flags.finetune_flags``)."""
    model, training = resolve(
        source, seq_len=seq_len, global_batch_size=global_batch_size, attention=attention, dropout=dropout,
        implementation=implementation,
    )
    model = finetune_flags(model, finetune, lora_rank, lora_targets, lora_alpha)
    updates: dict[str, Any] = {k: v for k, v in (("optimizer", optimizer), ("optimizer_impl", optimizer_impl))
                               if v is not None}
    if stack is not None:
        updates["stack"] = parse_stack(stack, "--stack")
    if updates:
        try:
            training = TrainConfig.model_validate({**training.model_dump(), **updates})
        except ValidationError as error:
            raise ConfigError(describe_validation_error(error, "training")) from None
    return model, training


def summarize_model(model: ModelConfig) -> ModelSummary:
    trained = count_trainable_params(model) if model.finetune is not None else None
    return ModelSummary(name=model.name, family=model.family.value, n_params=count_params(model), config=model,
                        n_trainable_params=trained)


def estimate_plan(
    model: ModelConfig,
    training: TrainConfig,
    hardware: str | Path | HardwareProfile | None,
    knobs: Knobs,
    hbm: str | int | None = None,
    gpus_per_node: int | None = None,
    headroom: str | int | float | None = None,
) -> PlanResult:
    """The estimate of one fully fixed configuration (``knobs.parallel.world_size`` GPUs), as a plan
    result; ``gpus_per_node`` (default: the hardware profile's) sets the node the GPUs sit in, and
    ``headroom`` (a fraction of the cap or a size) is kept free of the cap it must fit in."""
    hw = system(hardware, gpus_per_node)
    cap = hbm_cap(hw, hbm)
    kept = headroom_bytes(cap, headroom)
    result = estimate(model, training, hw, knobs, hbm_cap_bytes=cap - kept)
    return Plan(
        model=summarize_model(model),
        training=training,
        hardware=hw,
        hbm_cap_bytes=cap,
        headroom_bytes=kept,
        parallel=ParallelConfig(world_size=knobs.parallel.world_size, gpus_per_node=hw.gpus_per_node),
        best=PlanEntry(knobs=knobs, estimate=result),
    )


def system(hardware: str | Path | HardwareProfile | None, gpus_per_node: int | None) -> HardwareProfile:
    """The device and the node it sits in: the profile, with ``--gpus-per-node`` when given (the
    one place the topology is set: everything downstream reads ``gpus_per_node`` off the profile)."""
    if gpus_per_node is not None and gpus_per_node <= 0:
        raise ConfigError(f"--gpus-per-node: must be positive, got {gpus_per_node}")
    return load_hardware(hardware).with_gpus_per_node(gpus_per_node)


def plan(
    model: ModelConfig,
    training: TrainConfig,
    hardware: str | Path | HardwareProfile | None = None,
    hbm: str | int | None = None,
    *,
    precisions: Sequence[str] | None = None,
    micro_batch_size: int | None = None,
    checkpoint: str | Sequence[int] | None = None,
    sampler: str = "tpe",
    n_trials: int = 30,
    seed: int = 0,
    storage: str | None = None,
    study_name: str | None = None,
    allow_segments: bool = True,
    on_trial: Callable[[int, int], None] | None = None,
    gpus: int = 1,
    gpus_per_node: int | None = None,
    zero_stage: int | None = None,
    fsdp_grad_sync: str | GradSync = GradSync.EVERY,
    tp: int | None = None,
    sequence_parallel: bool = True,
    on_stage: Callable[[str], None] | None = None,
    cp: int | None = None,
    checkpoint_policy: str | CheckpointPolicy | None = None,
    save_list: str | SaveList | None = None,
    ep: int | None = None,
    headroom: str | int | float | None = None,
    pp: int | None = None,
    pp_schedule: str | PipelineSchedule | None = None,
    pp_layers: str | Sequence[int] | None = None,
    pp_virtual: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    dp_replicate: int | None = None,
    stack: str | None = None,
) -> PlanResult:
    """The fastest plan that fits: knobs left as None are searched (optuna), the others fixed.

    ``gpus`` is every GPU of the job: groups of ``tp`` tensor-parallel ranks (searched when None;
    with sequence parallelism unless ``sequence_parallel`` is False), ``cp`` such groups sharing
    each sequence (context parallelism: ring attention; searched when None), data parallel over
    those at ``zero_stage`` (under context parallelism FSDP2 shards over the data- and
    context-parallel ranks); on a model with MoE blocks ``ep`` of FSDP2's data-parallel ranks
    split each block's experts (expert parallelism, all-to-all; searched when None). ``fsdp_grad_sync`` ("every" or "last") is how ZeRO-2/3 plans
    accumulate gradients; it is fixed, not searched.

    ``checkpoint`` is ``"none"``, ``"all"``, ``"0,2,5-9"`` or a list of block indices, checkpointed
    with ``checkpoint_policy`` ("full", "attention" or "ops"; searched over the policies worth
    trying when None), "ops" keeping ``save_list`` (torchtitan's by default, or a comma list of
    matmul, attention, reduce_scatter). ``headroom`` (``0.05``, ``"2GB"``) is kept free of the cap. Raises
    ``InfeasibleError`` (exit code 1 on the command line) when nothing fits, with the smallest
    plan found and what would make it fit. ``on_trial(done, planned)`` follows the search's
    trials, ``on_stage(text)`` names each longer step without trials (the smallest plan and the
    fewest GPUs, when nothing fits), ``on_progress(done, total)`` counts that step's work. ``pp`` > 1
    splits the blocks into that many pipeline stages (``pp_layers`` blocks each, else evenly) run by
    ``pp_schedule`` with ``pp_virtual`` stages per rank (``roofplan.pipeline_flags``); each left as
    None is searched (pp over the degrees dividing the GPUs, the schedules of
    ``search.space.SEARCHED_SCHEDULES``). ``dp_replicate`` > 1 is HSDP: FSDP2 (ZeRO-2/3) shards
    over the data-parallel ranks / dp_replicate and all-reduces each sharded gradient across that
    many replicas; None searches it across nodes (each replica whole nodes), 1 turns it off.
    ``stack`` (pytorch, torchtitan, torchtitan-compile, llm-foundry, megatron; ``hardware/stacks``)
    overrides ``training.stack``: the kernels the step is timed with and the residual fitted to that
    stack's published runs.
    """
    if stack is not None:
        training = training.model_copy(update={"stack": parse_stack(stack, "--stack")})
    hw = system(hardware, gpus_per_node)
    check_finetune_gpus(model, gpus)
    ckpt_policy = checkpoint_policy_flag(checkpoint_policy)
    if save_list is not None and ckpt_policy not in (None, CheckpointPolicy.OPS):
        raise ConfigError(f"--save-list: applies to --checkpoint-policy ops (per-op selective checkpointing), not "
                          f"{ckpt_policy.value}; leave it out or use --checkpoint-policy ops")
    asked = _Asked(
        hw=hw, **_caps(hw, hbm, headroom), gpus=gpus, policies=precisions_flag(precisions), micro_batch_size=micro_batch_size,
        blocks=checkpoint_blocks_flag(checkpoint, model.n_layers), checkpoint_policy=ckpt_policy,
        save_list=save_list if isinstance(save_list, SaveList) else parse_save_list(save_list or "torchtitan"),
        grad_sync=grad_sync_flag(fsdp_grad_sync, gpus, zero_stage), allow_segments=allow_segments,
        layout=checked_request(model, LayoutRequest(gpus=gpus, zero_stage=zero_stage, tp=tp, cp=cp, ep=ep,
                                                    sp=sequence_parallel, pp=_searched_degree(pp, gpus, lambda: pipeline_degrees(model, gpus, None, hw.gpus_per_node)),
                                                    dp_replicate=_searched_degree(dp_replicate, gpus, lambda: replicate_degrees(gpus, None, hw.gpus_per_node)))),
        pipeline=pipeline_request(pp_schedule, pp_layers, pp, pp_virtual))
    if asked.fixed:
        return _fixed_plan(model, training, asked)
    from search.study import SamplerKind, SearchOptions

    if sampler not in {k.value for k in SamplerKind}:
        raise ConfigError(f"--sampler: {sampler!r} is not a sampler; use {', '.join(k.value for k in SamplerKind)}")
    try:
        options = SearchOptions(sampler=SamplerKind(sampler), n_trials=n_trials, seed=seed, storage=storage,
                                study_name=study_name)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, "search options")) from None
    return _searched_plan(model, training, asked, options, on_trial, on_stage, on_progress)


def _searched_degree(given: int | None, gpus: int, candidates: Callable[[], tuple[int, ...]]) -> int | None:
    """A degree flag (``--pp``, ``--dp-replicate``), or None where the search has degrees to try
    (``candidates``: the layout authority's, across nodes), else 1 (one node: a request fixing every
    other degree is then fixed)."""
    if given is not None or gpus < 1:
        return given
    return None if candidates() != (1,) else 1


def _caps(hw: HardwareProfile, hbm: str | int | None, headroom: str | int | float | None) -> dict[str, int]:
    """``--hbm`` and ``--headroom``, checked: the cap and the bytes of it kept free."""
    cap = hbm_cap(hw, hbm)
    return {"cap": cap, "headroom": headroom_bytes(cap, headroom)}


@dataclass(frozen=True)
class _Asked:
    """What a ``plan`` call asks for, its flags checked."""

    hw: HardwareProfile
    cap: int  # --hbm, or the device's memory
    headroom: int  # bytes of it kept free
    gpus: int
    policies: tuple[PrecisionPolicy, ...] | None
    micro_batch_size: int | None
    blocks: tuple[int, ...] | None
    checkpoint_policy: CheckpointPolicy | None
    save_list: SaveList
    grad_sync: GradSync
    allow_segments: bool
    layout: LayoutRequest
    pipeline: PipelineRequest  # --pp-schedule, --pp-layers, --pp-virtual

    @property
    def fixed(self) -> bool:
        """Every knob given: one configuration to price, nothing to search."""
        return (self.micro_batch_size is not None and self.policies is not None and len(self.policies) == 1
                and self.blocks is not None and self.layout.fixed)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(world_size=max(self.gpus, 1), gpus_per_node=self.hw.gpus_per_node)

    @property
    def search_cap(self) -> int:
        """What every plan must fit in: the cap less the headroom."""
        return self.cap - self.headroom


def _fixed_plan(model: ModelConfig, training: TrainConfig, asked: _Asked) -> PlanResult:
    """The estimate of the one configuration every flag fixes."""
    request, micro_batch_size, policies = asked.layout, asked.micro_batch_size, asked.policies
    assert micro_batch_size is not None and policies is not None and asked.blocks is not None
    check_fixed_request(model, training, request, asked.hw.gpus_per_node)
    pp = request.pp or 1
    per_rank = training.global_batch_size * (request.tp or 1) * (request.cp or 1) * pp // asked.gpus
    if micro_batch_size <= 0 or per_rank % micro_batch_size:
        raise ConfigError(f"--micro-batch: {micro_batch_size} must be a positive divisor of the {per_rank} "
                          "sequences each data-parallel rank gets per step")
    knobs = Knobs(
        micro_batch_size=micro_batch_size,
        grad_accum_steps=per_rank // micro_batch_size,
        precision=policies[0],
        checkpoint_blocks=asked.blocks,
        checkpoint_policy=asked.checkpoint_policy or CheckpointPolicy.FULL,
        save_list=asked.save_list,
        parallel=fixed_layout(request),
        fsdp_grad_sync=asked.grad_sync,
        pp_schedule=asked.pipeline.schedule_or_default,
        pp_layers=asked.pipeline.layers,
        pp_virtual=asked.pipeline.virtual_or_default,
    )
    return estimate_plan(model, training, asked.hw, knobs, hbm=asked.cap, headroom=asked.headroom)


def _searched_plan(model: ModelConfig, training: TrainConfig, asked: _Asked, options: SearchOptions,
                   on_trial: Callable[[int, int], None] | None, on_stage: Callable[[str], None] | None,
                   on_progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """The fastest plan of the space the flags leave open, or ``InfeasibleError`` with the
    smallest plan and the fewest GPUs that would hold one."""
    from search.space import build_space
    from search.study import run_search

    hw, cap, request = asked.hw, asked.search_cap, asked.layout
    plan_cap = {"hbm_cap_bytes": asked.cap, "headroom_bytes": asked.headroom}
    space = build_space(model, training, hw, asked.policies, asked.micro_batch_size, asked.blocks,
                        asked.allow_segments, asked.gpus, request.zero_stage, asked.grad_sync,
                        tensor_parallel=request.tp, sequence_parallel=request.sp, context_parallel=request.cp,
                        checkpoint_policy=asked.checkpoint_policy, save_list=asked.save_list,
                        expert_parallel=request.ep, on_left_out=_warn, pipeline_parallel=request.pp,
                        pp_schedule=asked.pipeline.schedule, pp_virtual=asked.pipeline.virtual,
                        pp_layers=asked.pipeline.layers, dp_replicate=request.dp_replicate)
    outcome = run_search(model, training, hw, cap, space, options, on_trial, on_stage, on_progress)
    summary = summarize_model(model)
    if outcome.best is None:
        if outcome.closest is None:
            raise InfeasibleError(f"nothing fits in {cap} bytes on {hw.name}, and no plan could be priced")
        closest = Plan(model=summary, training=training, hardware=hw, **plan_cap, parallel=asked.parallel,
                       best=outcome.closest, search=outcome.stats)
        scale = {"precisions": space.precisions, "gpus": asked.gpus, "grad_sync": asked.grad_sync,
                 "allow_segments": asked.allow_segments, "checkpoint_policy": asked.checkpoint_policy,
                 "save": asked.save_list,
                 "pipeline": (request.pp, asked.pipeline.schedule, asked.pipeline.virtual)
                 if request.pp is not None and request.pp > 1 else None}
        raise infeasible_error(model, training, hw, cap, space, closest, asked.headroom, scale, on_stage, on_progress)
    return Plan(model=summary, training=training, hardware=hw, **plan_cap, parallel=asked.parallel,
                best=outcome.best, alternatives=outcome.alternatives, pareto=outcome.pareto, search=outcome.stats)


def validate(
    plan: PlanResult | str | Path,
    mode: str = "auto",
    device: str | None = None,
    steps: int = 5,
    hardware: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    implementation: str | None = None,
) -> Any:
    """Run ``plan`` (a PlanResult or a plan file) in PyTorch and compare: returns a
    ``validate.report.ValidationReport`` (``rich.print`` shows it). Imports torch (lazily, here).
    ``progress`` is called with each stage's description as it starts. ``implementation`` runs
    that library's model (``hf``: transformers') instead of the plan's (default: the plan's)."""
    try:
        from validate.api import validate as run_validation
    except ImportError:
        raise ConfigError("validate: needs torch; pip install torch (or roofplan[validate])") from None
    from roofplan.validate_render import shown_validation

    return shown_validation(run_validation(plan, mode=mode, device=device, steps=steps, hardware=hardware,
                                           progress=progress, implementation=implementation))


def _warn(line: str) -> None:
    """A note on what the request left out (``plan: warning: ...`` on the command line)."""
    import warnings

    warnings.warn(line, ConfigWarning, stacklevel=3)


__all__ = [
    "ConfigError",
    "InfeasibleError",
    "Knobs",
    "ModelConfig",
    "ModelSummary",
    "OptimizerImpl",
    "OptimizerKind",
    "ParallelConfig",
    "ParetoPoint",
    "PlanEntry",
    "Plan",
    "PlanResult",
    "SearchStats",
    "TrainConfig",
    "estimate_plan",
    "hbm_cap",
    "load_hardware",
    "load_model",
    "parse_checkpoint_spec",
    "plan",
    "summarize_model",
    "validate",
]
