"""One rank of ``torch.distributed.pipelining`` in one process: what it allocates, action by action.

``measure_rank(case, rank)`` builds that rank's stages of the reference model
(``validate.pipeline_split``), wraps them in ``PipelineStage`` and runs the rank's part of a
schedule on a fake process group of ``pp`` ranks (``init_process_group("fake")``: every send and
receive completes at once and leaves its buffer as it was), counting every storage with the
live-storage tracker (``validate.tracker``). Each forward (F), loss (L), full backward (B),
backward-input (I) and backward-weight (W) of a micro-batch is recorded with its peak and the live
bytes after it, split into categories (``CATEGORIES``) by what holds each storage
(``validate.pipeline_record``). A case can also carry what a plan adds (``validate.pipeline_validate``):
autocast, checkpointing, the optimizer stepped after every step, DDP's resident gradients.

What a lone rank cannot do on a fake group, and what replaces it (``fake_pipeline_group``):
- the warm-up vote (``schedules.py:_warmup_p2p`` -> ``stage.py:_warmup_forward_vote``) reads a zero
  tensor ("dynamic"): the patch sets each stage to the mode the real vote reaches;
- dynamic metadata (``stage.py:_recv_meta``) unpickles garbage: the patch hands each stage the
  metadata its neighbour would send (hidden states forward, their gradient backward); received
  buffers are filled in place (no allocation) before use, so the numbers stay finite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining._utils import InferenceMode, _StageBackwardMeta, _StageForwardMeta, _TensorMeta

from planner.model.config import ModelConfig
from validate.pipeline_record import (  # noqa: F401  (re-exported: the harness's records)
    CATEGORIES,
    ActionRecord,
    PipelineTracker,
    StepRecord,
    _Recorder,
    classify,
    in_flight,
)
from validate.pipeline_split import StageModel, build_stage_models, pipeline_loss, stage_indices

# schedule class name -> (stages per rank it needs, None: any v >= 2 ; stage placement style)
SCHEDULES: dict[str, tuple[int | None, str]] = {
    "ScheduleGPipe": (1, "loop"), "Schedule1F1B": (1, "loop"), "ScheduleInterleaved1F1B": (None, "loop"),
    "ScheduleLoopedBFS": (None, "loop"), "ScheduleInterleavedZeroBubble": (None, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"), "ScheduleDualPipeV": (2, "v"),
}


@dataclass(frozen=True)
class PipelineCase:
    """One pipeline run: ``pp`` ranks, ``v`` stages per rank, ``n_microbatches`` of ``micro_batch``
    sequences of ``seq_len`` tokens per step; ``metadata`` "static" gives every ``PipelineStage``
    its example tensors, "dynamic" lets the schedule infer them (a real forward/backward at step 1)."""

    config: ModelConfig
    pp: int
    schedule: str = "Schedule1F1B"
    v: int = 1
    n_microbatches: int = 4
    micro_batch: int = 1
    seq_len: int = 64
    dtype: torch.dtype = torch.float32
    layers_per_stage: tuple[int, ...] | None = None
    return_outputs: bool = False
    metadata: str = "static"
    dp_shard: int = 1  # > 1: every stage FSDP2-sharded over a data-parallel group (validate.pipeline_fsdp)
    reshard_after_forward: bool = False
    mixed_precision: bool = False  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    autocast: torch.dtype | None = None  # each stage's forward under torch.autocast (a mixed policy without FSDP2)
    prepare: Callable[[StageModel], None] | None = None  # applied to every stage module once built
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None  # stepped after every step
    keep_grads: bool = False  # gradients allocated up front and zeroed in place (DDP's buckets), not set to None

    @property
    def activation_dtype(self) -> torch.dtype:  # what flows between the stages
        return torch.bfloat16 if self.mixed_precision else self.dtype

    @property
    def logits_dtype(self) -> torch.dtype:  # the last stage's output: autocast's dtype under autocast
        return self.autocast or self.activation_dtype

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    @property
    def style(self) -> str:
        return SCHEDULES[self.schedule][1]


@dataclass
class RankMeasurement:
    case: PipelineCase
    rank: int
    stages: list[int]
    param_bytes: int
    steps: list[StepRecord]


def _meta(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool) -> _TensorMeta:
    return _TensorMeta.from_tensor(torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad))


@contextlib.contextmanager
def fake_pipeline_group(case: PipelineCase, rank: int) -> Iterator[None]:
    """Rank ``rank`` of a fake process group of ``case.pp`` ranks, with the warm-up vote and
    the metadata exchange answered as the other ranks would (see the module docstring)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hidden = (case.micro_batch, case.seq_len, case.config.d_model)
    mode = InferenceMode.STATIC if case.metadata == "static" else InferenceMode.DYNAMIC

    def warmup_p2p(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = mode

    def recv_meta(self: PipelineStage, src_stage: int) -> Any:
        if src_stage < self.stage_index:
            return _StageForwardMeta(forward_metas=(_meta(hidden, case.activation_dtype, True),))
        return _StageBackwardMeta(backward_metas=(_meta(hidden, case.activation_dtype, False),))

    patches = ((schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p), (PipelineStage, "_recv_meta", recv_meta),
               (PipelineStage, "_send_meta", lambda self, meta, dst_stage: None))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    # ranks laid out [pp, dp_shard] (dp innermost): the pipeline rank's first data-parallel rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank * case.dp_shard, world_size=case.pp * case.dp_shard)
    try:
        for owner, name, patched in patches:
            setattr(owner, name, patched)
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        dist.destroy_process_group()


def _make_stages(case: PipelineCase, rank: int, group: Any = None) -> list[PipelineStage]:
    indices = stage_indices(rank, case.pp, case.v, case.style)
    models = build_stage_models(case.config, case.dtype, case.n_stages, indices, case.layers_per_stage)
    hidden = (case.micro_batch, case.seq_len, case.config.d_model)
    logits = (case.micro_batch, case.seq_len, case.config.vocab_size)
    stages = []
    for index, model in zip(indices, models, strict=True):
        model.autocast = case.autocast
        if case.prepare is not None:
            case.prepare(model)
        example: dict[str, Any] = {}
        if case.metadata == "static":
            first, last = index == 0, index == case.n_stages - 1
            example["input_args"] = (torch.empty(hidden[:2], dtype=torch.long, device="meta") if first else
                                     torch.empty(hidden, dtype=case.activation_dtype, device="meta", requires_grad=True))
            example["output_args"] = torch.empty(logits if last else hidden, device="meta", requires_grad=True,
                                                 dtype=case.logits_dtype if last else case.activation_dtype)
        stages.append(PipelineStage(model, index, case.n_stages, torch.device("cpu"), group=group, **example))
    return stages


def _make_schedule(case: PipelineCase, stages: list[PipelineStage]) -> Any:
    per_rank, _ = SCHEDULES[case.schedule]
    if per_rank is not None and case.v != per_rank:
        raise ValueError(f"{case.schedule} runs {per_rank} stage(s) per rank, not {case.v}")
    cls = getattr(schedules, case.schedule)
    if per_rank == 1:
        return cls(stages[0], case.n_microbatches, loss_fn=pipeline_loss)
    return cls(stages, case.n_microbatches, loss_fn=pipeline_loss)


def _fill_received(buffers: list[Any]) -> None:
    with torch.no_grad():
        for buffer in buffers:
            if isinstance(buffer, torch.Tensor) and buffer.is_floating_point():
                buffer.fill_(0.01)  # in place: no storage is created


def _wrap_stage(stage: PipelineStage, local: set[int], recorder: _Recorder) -> None:
    """Instance-level wrappers around ``stage.py:_PipelineStageBase.forward_one_chunk``,
    ``backward_one_chunk`` and ``backward_weight_one_chunk`` (every schedule calls them through
    the stage); buffers received from another rank are filled first."""
    run_forward, run_backward, run_weight = (stage.forward_one_chunk, stage.backward_one_chunk,
                                             stage.backward_weight_one_chunk)

    def forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
        if not stage.is_first and stage.stage_index - 1 not in local:
            _fill_received([info.buffer for info in stage.args_recv_info[chunk]])
        return recorder.run("F", stage.stage_index, chunk, lambda: run_forward(chunk, *args, **kwargs))

    def backward(chunk: int, *args: Any, **kwargs: Any) -> Any:
        if not stage.is_last and stage.stage_index + 1 not in local:
            _fill_received([info.buffer for info in stage.grad_recv_info[chunk]])
        kind = "B" if kwargs.get("full_backward", True) else "I"
        return recorder.run(kind, stage.stage_index, chunk, lambda: run_backward(chunk, *args, **kwargs))

    def weight(chunk: int, *args: Any, **kwargs: Any) -> Any:
        return recorder.run("W", stage.stage_index, chunk, lambda: run_weight(chunk, *args, **kwargs))

    for name, wrapper in (("forward_one_chunk", forward), ("backward_one_chunk", backward),
                          ("backward_weight_one_chunk", weight)):
        setattr(stage, name, wrapper)  # instance attributes shadow the methods


def _instrument(stages: list[PipelineStage], schedule: Any, recorder: _Recorder) -> None:
    """Wrap the stages' actions and the schedule's ``schedules.py:_maybe_compute_loss`` and
    ``_initialize_pp_stages`` (both called through ``self``)."""
    local = {stage.stage_index for stage in stages}
    for stage in stages:
        _wrap_stage(stage, local, recorder)
    compute_loss, initialize = schedule._maybe_compute_loss, schedule._initialize_pp_stages

    def maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb_index: int, loss_kwargs: Any = None) -> Any:
        if not (stage.is_last and schedule._loss_fn is not None):
            return None
        return recorder.run("L", stage.stage_index, mb_index,
                            lambda: compute_loss(stage, output, target_mbs, mb_index, loss_kwargs))

    def initialize_pp_stages(*args: Any, **kwargs: Any) -> Any:
        return recorder.run("init", stages[0].stage_index, -1, lambda: initialize(*args, **kwargs))

    schedule._maybe_compute_loss, schedule._initialize_pp_stages = maybe_compute_loss, initialize_pp_stages


def run_steps(case: PipelineCase, schedule: Any, tracker: PipelineTracker, recorder: Any, steps: int,
              ids: torch.Tensor | None, targets: torch.Tensor | None, params: list[torch.Tensor]) -> None:
    """``steps`` of ``schedule`` (first stage fed ``ids``, last ``targets``), each followed by
    ``case.optimizer``'s step if any (an "OPT" action); gradients None between steps, or zeroed in
    place with ``case.keep_grads`` (allocated before the first step, as DDP's buckets are)."""
    optimizer = case.optimizer(params) if case.optimizer is not None else None
    if case.keep_grads:
        for p in params:
            p.grad = torch.zeros_like(p)
    for index in range(steps):
        tracker.classify_peaks = index == steps - 1
        recorder.begin_step()
        losses: list[torch.Tensor] = []
        schedule.step(*((ids,) if ids is not None else ()), target=targets,
                      losses=losses if targets is not None else None, return_outputs=case.return_outputs)
        del losses
        if optimizer is not None:
            recorder.run("OPT", -1, -1, optimizer.step)
        recorder.end_step()
        for p in params:
            if case.keep_grads and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None


def measure_rank(case: PipelineCase, rank: int, steps: int = 2) -> RankMeasurement:
    """Run ``steps`` training steps of rank ``rank`` (gradients set to None between steps, no optimizer;
    ``dp_shard > 1`` is ``validate.pipeline_fsdp.measure_fsdp_rank``'s) with every allocation after the parameters and the batch counted."""
    if not 0 <= rank < case.pp:
        raise ValueError(f"rank {rank} is not in a pipeline of {case.pp}")
    if case.dp_shard > 1:
        raise ValueError("measure_rank runs unsharded stages; FSDP2-sharded ones (dp_shard > 1): "
                         "validate.pipeline_fsdp.measure_fsdp_rank")
    with fake_pipeline_group(case, rank):
        stages = _make_stages(case, rank)
        schedule = _make_schedule(case, stages)
        torch.manual_seed(1)
        rows = case.micro_batch * case.n_microbatches
        ids = torch.randint(0, case.config.vocab_size, (rows, case.seq_len))
        targets = torch.roll(ids, -1, dims=1)
        has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        params = [p for s in stages for p in s.submod.parameters()]
        batch = [ids, targets]
        classifier = lambda live: classify(stages, schedule, batch, live)  # noqa: E731
        tracker = PipelineTracker(classifier)
        tracker.track([*params, *batch])
        recorder = _Recorder(tracker, classifier)
        _instrument(stages, schedule, recorder)
        with tracker:
            run_steps(case, schedule, tracker, recorder, steps, ids if has_first else None,
                      targets if has_last else None, params)
        param_bytes = sum(tracker._live.get(id(p.untyped_storage()), 0) for p in params)
        return RankMeasurement(case, rank, [s.stage_index for s in stages], param_bytes, recorder.steps)
