"""``validate`` of a pipeline-parallel plan: each pipeline rank's step run by torch.distributed.pipelining.

``simulate_pipeline(plan)`` runs the plan as the harness of ``validate.pipeline`` runs a case: the
reference model cut into the plan's stages (``pp_layers``, ``pp_virtual``), the plan's torch
schedule over ``grad_accum_steps`` micro-batches of ``micro_batch_size`` sequences, its precision
(parameters in the policy's dtype; a mixed policy's forward under autocast, or FSDP2's
``MixedPrecisionPolicy``), its checkpointing on every stage, its optimizer stepped after each
``schedule.step``; one rank of a fake process group at a time, under fake tensors (any model size),
two steps, the second measured by the live-storage tracker. Each measured rank's peak is compared
with the planner's (``best.estimate.stages``): every rank of a pipeline of up to
``ALL_RANKS_UP_TO`` ranks, else the first, the middle, the last and the busiest predicted.

Data parallelism under the pipeline: FSDP2 (ZeRO-2/3) shards every stage over a fake
[pp, dp_shard] mesh (``validate.pipeline_fsdp``); DDP is emulated as ``validate.distributed``
emulates it (gradients allocated up front as its buckets, zeroed in place, no all-reduce), ZeRO-1
too (the optimizer holds the largest ``ZeroRedundancyOptimizer`` partition of each stage). What the
harness cannot run is refused in one line (``check_runnable``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from hardware.errors import ConfigError
from hardware.units import format_bytes
from planner.model.config import ModelConfig, TrainConfig
from planner.ops.base import ParamTensor
from planner.parallel.collectives import zero1_partition
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import Sharding, layout_label
from planner.plan.pipeline_schedules import PipelineSchedule
from planner.precision import PrecisionPolicy, precision_spec
from planner.program.estimate import Estimate, estimate
from planner.program.results import PlanResult
from validate.apply import TORCH_DTYPES, _optimizer_args, param_dtype
from validate.pipeline import PipelineCase, RankMeasurement, measure_rank
from validate.pipeline_fsdp import measure_fsdp_rank
from validate.pipeline_split import StageModel, checkpoint_stage, split_layers
from validate.report import TOLERANCES, Figures, Mode, RankComparison, ValidationReport
from validate.simulate import Progress, as_on_a_gpu, simulated_dropout_note

TORCH_SCHEDULES = {
    PipelineSchedule.GPIPE: "ScheduleGPipe", PipelineSchedule.ONE_F_ONE_B: "Schedule1F1B",
    PipelineSchedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B", PipelineSchedule.LOOPED_BFS: "ScheduleLoopedBFS",
    PipelineSchedule.INTERLEAVED_ZERO_BUBBLE: "ScheduleInterleavedZeroBubble",
    PipelineSchedule.ZBV_ZERO_BUBBLE: "ScheduleZBVZeroBubble", PipelineSchedule.DUALPIPEV: "ScheduleDualPipeV",
}
# FSDP2 under a pipeline is run for these (docs/pipeline_memory.md section 9.4: not under the split-backward
# schedules; LoopedBFS runs, with the planner's limit of 3 stages per rank that torch keeps gathered)
FSDP_SCHEDULES = frozenset({PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B,
                            PipelineSchedule.LOOPED_BFS})
ALL_RANKS_UP_TO = 4  # larger pipelines: the first, middle, last and busiest ranks
MAX_MICRO_BATCHES = 16  # more (and more than twice the pipeline): a shorter step, re-priced (measured_micro_batches)


def check_runnable(plan: PlanResult) -> None:
    """Refuse, in one line naming what is not supported and what to do, a pipeline plan the harness
    cannot run."""
    model, knobs = plan.model.config, plan.best.knobs
    dims, pp = knobs.parallel, knobs.parallel.pp
    inside = [f"{name} {degree}" for name, degree in (("tensor parallelism --tp", dims.tp),
                                                       ("context parallelism --cp", dims.cp),
                                                       ("expert parallelism --ep", dims.ep)) if degree > 1]
    if inside:
        raise ConfigError(f"{', '.join(inside)} inside a pipeline (--pp {pp}) is not run by the pipeline harness "
                          "(it runs whole stages, data-parallel at most); validate the plan with --tp/--cp/--ep 1, "
                          "or without --pp")
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        raise ConfigError(f"HSDP ({dims.dp_replicate} replicas x {dims.dp_shard} shards) under a pipeline (--pp {pp}) "
                          "is not run by the pipeline harness; validate a plan with DDP, ZeRO-1 or FSDP2 alone")
    if model.moe is not None:
        raise ConfigError(f"--pp {pp}: {plan.model.name} has MoE blocks and the pipeline harness splits dense models "
                          "only; validate it without --pp")
    if model.tie_embeddings:
        raise ConfigError(f"--pp {pp}: {plan.model.name} ties its LM head to its embedding, which a pipeline puts on "
                          "different stages (torchtitan refuses it too); validate a model with tie_embeddings: false")
    spec = precision_spec(knobs.precision)
    if spec.loss_scaling or spec.policy is PrecisionPolicy.FP8_MIXED:
        raise ConfigError(f"--precision {knobs.precision.value} under a pipeline (--pp {pp}) is not run by the "
                          "pipeline harness (its loss_fn runs no loss scaler or fp8 recipe); validate fp32, tf32, "
                          "bf16-mixed or bf16-true")
    if dims.shards_parameters and knobs.pp_schedule not in FSDP_SCHEDULES:
        names = ", ".join(sorted(s.value for s in FSDP_SCHEDULES))
        raise ConfigError(f"--pp-schedule {knobs.pp_schedule.value} under FSDP2 (--zero-stage "
                          f"{2 if dims.sharding is Sharding.GRADIENTS else 3}) is not run by the pipeline harness "
                          f"(validate/pipeline_fsdp.py runs {names}); validate one of those, or --zero-stage 0/1")
    spans = split_layers(model.n_layers, pp * knobs.pp_virtual, tuple(knobs.pp_layers) or None)
    starts = {span.start for span in spans}
    for first, last in knobs.checkpoint_segments:
        if any(first < start <= last for start in starts):
            raise ConfigError(f"checkpoint segment {first}-{last} crosses a pipeline stage boundary, which the "
                              "pipeline harness cannot run; checkpoint the blocks within each stage")


def measured_ranks(pp: int, busiest: int) -> tuple[int, ...]:
    """Every rank of a short pipeline; of a longer one the first, middle, last and busiest."""
    if pp <= ALL_RANKS_UP_TO:
        return tuple(range(pp))
    return tuple(sorted({0, pp // 2, pp - 1, busiest}))


def pipeline_case(model: ModelConfig, training: TrainConfig, knobs: Knobs) -> PipelineCase:
    """A plan's knobs as a harness case (see the module docstring)."""
    dims, spec = knobs.parallel, precision_spec(knobs.precision)
    fsdp = dims.shards_parameters
    low = TORCH_DTYPES[spec.autocast_dtype.value] if spec.autocast_dtype is not None else None
    chosen: set[int] = set()  # ZeRO-1: the parameters of each stage's largest partition

    def prepare(stage: StageModel) -> None:
        checkpoint_stage(stage, knobs)
        as_on_a_gpu(stage)
        if dims.sharding is Sharding.OPTIMIZER:
            chosen.update(id(p) for p in _largest_partition(stage, dims.data_parallel))

    cls, kwargs = _optimizer_args(training)

    def optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return cls([p for p in params if not chosen or id(p) in chosen], **kwargs)

    return PipelineCase(
        model, pp=dims.pp, schedule=TORCH_SCHEDULES[knobs.pp_schedule], v=knobs.pp_virtual,
        n_microbatches=knobs.grad_accum_steps, micro_batch=knobs.micro_batch_size, seq_len=training.seq_len,
        dtype=param_dtype(spec), layers_per_stage=tuple(knobs.pp_layers) or None,
        # FSDP2 under a pipeline keeps a stage gathered from its first forward (reshard_after_forward=False
        # for ZeRO-2 and 3 alike), as torchtitan runs it and the planner prices it (planner.parallel.fsdp_pipeline)
        dp_shard=dims.dp_shard if fsdp else 1, reshard_after_forward=False,
        mixed_precision=fsdp and low is not None, autocast=None if fsdp else low, prepare=prepare,
        optimizer=optimizer, keep_grads=dims.data_parallel > 1 and not fsdp)


def _largest_partition(stage: StageModel, world: int) -> list[torch.Tensor]:
    """ZeroRedundancyOptimizer's partition of the stage's parameters (``zero1_partition``, as the
    planner partitions them) with the most elements."""
    named = dict(stage.named_parameters())
    parts = zero1_partition([ParamTensor(name=name, numel=p.numel()) for name, p in named.items()], world)
    return [named[p.name] for p in max(parts, key=lambda part: sum(p.numel for p in part))]


def measure(case: PipelineCase, rank: int) -> RankMeasurement:
    """One rank of ``case`` under fake tensors (FSDP2-sharded stages through ``validate.pipeline_fsdp``)."""
    if case.dp_shard == 1:
        with FakeTensorMode():
            return measure_rank(case, rank)
    with FakeTensorMode(), meshes_on_real_tensors():
        return measure_fsdp_rank(case, rank)


@contextlib.contextmanager
def meshes_on_real_tensors() -> Iterator[None]:
    """``validate.pipeline_fsdp`` builds its [pp, dp_shard] mesh inside the measurement; under fake
    tensors the mesh's rank map (``init_device_mesh``: ``torch.arange``, then ``.tolist()``) must be
    real, so its ``init_device_mesh`` runs with the fake mode set aside."""
    import validate.pipeline_fsdp as fsdp

    original = fsdp.init_device_mesh

    def init(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    fsdp.init_device_mesh = init
    try:
        yield
    finally:
        fsdp.init_device_mesh = original


def measured_micro_batches(m: int, pp: int) -> int:
    """The micro-batches a measured step runs: the plan's, or past ``MAX_MICRO_BATCHES`` (and
    twice the pipeline) a multiple of ``pp`` that still fills it twice."""
    if m <= max(MAX_MICRO_BATCHES, 2 * pp):
        return m
    return max(2 * pp, pp * (MAX_MICRO_BATCHES // pp))


def _shortened(plan: PlanResult, m: int) -> tuple[Knobs, TrainConfig, Estimate]:
    """The plan with ``m`` micro-batches per step, re-priced (the planner's own figures for them)."""
    knobs = plan.best.knobs.model_copy(update={"grad_accum_steps": m})
    training = plan.training.model_copy(update={"global_batch_size": knobs.sequences_per_step})
    return knobs, training, estimate(plan.model.config, training, plan.hardware, knobs, plan.hbm_cap_bytes)


def simulate_pipeline(plan: PlanResult, progress: Progress | None = None) -> ValidationReport:
    """Every pipeline rank (or the first, middle, last and busiest) measured under fake tensors on a
    fake process group, against the planner's per-rank peaks."""
    from validate.run import build_report

    say = progress or (lambda _text: None)
    check_runnable(plan)
    knobs, training, est = plan.best.knobs, plan.training, plan.best.estimate
    pp, m = knobs.parallel.pp, knobs.grad_accum_steps
    notes: tuple[str, ...] = ()
    short = measured_micro_batches(m, pp)
    if short < m:
        knobs, training, est = _shortened(plan, short)
        ours, theirs = est.memory.peak_allocated_bytes, plan.best.estimate.memory.peak_allocated_bytes
        notes += (f"measured a step of {short} of the plan's {m} micro-batches (faster; each micro-batch repeats the "
                  f"same pattern), against the plan re-priced for {short}: peak {format_bytes(ours)} (the plan's: "
                  f"{format_bytes(theirs)}; what grows with the count, receive buffers and GPipe's micro-batches in "
                  "flight, is the planner's)",)
    case = pipeline_case(plan.model.config, training, knobs)
    stages = {s.rank: s for s in est.stages}
    busiest = max(stages.values(), key=lambda s: s.peak_allocated_bytes).rank
    ranks = measured_ranks(pp, busiest)
    comparisons: list[RankComparison] = []
    for rank in range(pp):
        stage = stages[rank]
        comparison = RankComparison(
            rank=rank, stages=stage.stages, blocks=stage.blocks, predicted_peak_bytes=stage.peak_allocated_bytes,
            predicted_at=f"{stage.peak_phase.value} {stage.peak_op} (mb {stage.peak_micro_batch})",
            busiest=rank == busiest)
        if rank in ranks:
            say(f"pipeline rank {rank} of {pp}: {case.schedule}, {case.n_microbatches} micro-batches, fake tensors")
            step = measure(case, rank).steps[-1]
            error = step.peak_bytes / stage.peak_allocated_bytes - 1 if stage.peak_allocated_bytes else None
            comparison = comparison.model_copy(update={"measured_peak_bytes": step.peak_bytes, "error": error,
                                                       "measured_at": step.peak_action})
        comparisons.append(comparison)
    measured_peaks = [c.measured_peak_bytes for c in comparisons if c.measured_peak_bytes is not None]
    predicted = Figures(peak_allocated_bytes=est.memory.peak_allocated_bytes)
    measured = Figures(peak_allocated_bytes=max(measured_peaks))
    notes = pipeline_notes(knobs, case, ranks) + notes + simulated_dropout_note(plan.model.config)
    return build_report(plan, Mode.SIMULATE, "cpu (fake tensors, fake process group)", 1, predicted, measured,
                        fits=True, notes=notes, tolerances=TOLERANCES[(Mode.SIMULATE, "cpu")],
                        per_rank=tuple(Figures(peak_allocated_bytes=p) for p in measured_peaks),
                        pipeline_ranks=tuple(comparisons))


def pipeline_notes(knobs: Knobs, case: PipelineCase, ranks: tuple[int, ...]) -> tuple[str, ...]:
    """What was run and what was not (the report's notes)."""
    dims = knobs.parallel
    notes = [f"simulate: each pipeline rank's step ({case.schedule}, {case.n_microbatches} micro-batches of "
             f"{case.micro_batch}, {case.n_stages} stages) run by torch.distributed.pipelining alone on a fake process "
             f"group of {dims.pp * case.dp_shard} ranks under fake tensors, the second of two steps measured; sends "
             "complete at once, as on gloo (NCCL holds a send's tensors until it is waited); no time, no FLOPs"]
    if len(ranks) < dims.pp:
        notes.append(f"measured ranks {', '.join(map(str, ranks))} of {dims.pp} (first, middle, last and the busiest "
                     "predicted); the others are predicted only")
    if dims.shards_parameters:
        notes.append(f"{layout_label(dims)}: every stage FSDP2-sharded over {dims.dp_shard} ranks of a fake "
                     "[pp, dp_shard] mesh (validate/pipeline_fsdp.py) with reshard_after_forward=False, as torchtitan "
                     "runs FSDP2 under a pipeline; its first data-parallel rank measured")
    elif dims.data_parallel > 1:
        zero1 = dims.sharding is Sharding.OPTIMIZER
        notes.append(f"{layout_label(dims)}: data parallelism emulated on one rank: DDP's gradient buckets allocated "
                     "up front and zeroed in place, no all-reduce" +
                     ("; the optimizer holds each stage's largest ZeroRedundancyOptimizer partition" if zero1 else ""))
    return tuple(notes)


def refuse_run(plan: PlanResult) -> None:
    """``--mode run``: a real pipeline across processes is not run here."""
    pp = plan.best.knobs.parallel.pp
    raise ConfigError(f"--mode run: a pipeline-parallel plan (pp {pp}) is validated with --mode simulate (each "
                      "pipeline rank under torch.distributed.pipelining on a fake process group); real runs across "
                      "ranks are not supported for pipelines yet")

