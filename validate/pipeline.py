"""One rank of ``torch.distributed.pipelining`` in one process: what it allocates, action by action.

``measure_rank(case, rank)`` builds that rank's stages of the reference model
(``validate.pipeline_split``), wraps them in ``PipelineStage`` and runs the rank's part of a
schedule on a fake process group of ``pp`` ranks (``init_process_group("fake")``: every send and
receive completes at once and leaves its buffer as it was), counting every storage with the
live-storage tracker (``validate.tracker``). Each forward (F), loss (L), full backward (B),
backward-input (I) and backward-weight (W) of a micro-batch is recorded with its peak and the live
bytes after it, split into categories (``CATEGORIES``) by what holds each storage.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining._utils import InferenceMode, _StageBackwardMeta, _StageForwardMeta, _TensorMeta

from planner.model.config import ModelConfig
from validate.pipeline_split import build_stage_models, pipeline_loss, stage_indices
from validate.tracker import LiveStorageTracker

# schedule class name -> (stages per rank it needs, None: any v >= 2 ; stage placement style)
SCHEDULES: dict[str, tuple[int | None, str]] = {
    "ScheduleGPipe": (1, "loop"), "Schedule1F1B": (1, "loop"), "ScheduleInterleaved1F1B": (None, "loop"),
    "ScheduleLoopedBFS": (None, "loop"), "ScheduleInterleavedZeroBubble": (None, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"), "ScheduleDualPipeV": (2, "v"),
}
CATEGORIES = ("params", "grads", "batch", "fwd_recv", "bwd_recv", "outputs", "input_grads", "loss",
              "weight_state", "other")


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

    @property
    def activation_dtype(self) -> torch.dtype:  # what flows between the stages
        return torch.bfloat16 if self.mixed_precision else self.dtype

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    @property
    def style(self) -> str:
        return SCHEDULES[self.schedule][1]


@dataclass
class ActionRecord:
    """One action of the rank: ``kind`` F/L/B/I/W (or "init": the schedule's stage set-up)."""

    kind: str
    stage: int
    microbatch: int
    live_before: int
    peak_bytes: int
    live_after: int
    categories: dict[str, int]

    @property
    def added(self) -> int:
        """Live bytes the action itself left behind (what ran between actions is not in it)."""
        return self.live_after - self.live_before

    @property
    def label(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}" if self.microbatch >= 0 else f"{self.kind}@s{self.stage}"


@dataclass
class StepRecord:
    live_before: int
    peak_bytes: int = 0
    peak_categories: dict[str, int] = field(default_factory=dict)
    peak_action: str = ""
    actions: list[ActionRecord] = field(default_factory=list)
    live_after: int = 0
    categories_after: dict[str, int] = field(default_factory=dict)


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
        example: dict[str, Any] = {}
        if case.metadata == "static":
            first, last = index == 0, index == case.n_stages - 1
            example["input_args"] = (torch.empty(hidden[:2], dtype=torch.long, device="meta") if first else
                                     torch.empty(hidden, dtype=case.activation_dtype, device="meta", requires_grad=True))
            example["output_args"] = torch.empty(logits if last else hidden, dtype=case.activation_dtype,
                                                 device="meta", requires_grad=True)
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


def classify(stages: list[PipelineStage], schedule: Any, batch: list[torch.Tensor],
             live: dict[int, int]) -> dict[str, int]:
    """Live bytes by what holds each storage (first match in ``CATEGORIES`` order; "other" is what
    autograd saved for backward plus temporaries)."""
    owner: dict[int, str] = {}

    def mark(item: Any, category: str) -> None:
        if isinstance(item, torch.Tensor):
            owner.setdefault(id(item.untyped_storage()), category)
        elif isinstance(item, list | tuple):
            for inner in item:
                mark(inner, category)
        elif isinstance(item, dict):
            for inner in item.values():
                mark(inner, category)

    params = [p for stage in stages for p in stage.submod.parameters()]
    mark(params, "params")
    mark([p.grad for p in params], "grads")
    mark(batch, "batch")
    for stage in stages:
        for infos in stage.args_recv_info.values():
            mark([info.buffer for info in infos], "fwd_recv")
            mark([info.buffer.grad for info in infos if info.buffer is not None], "input_grads")
        for infos in stage.grad_recv_info.values():
            mark([info.buffer for info in infos], "bwd_recv")
        mark([out for out, _ in stage.fwd_cache.values()], "outputs")
        mark(stage.output_chunks, "outputs")
        mark(list(stage.bwd_cache.values()), "input_grads")
    mark(schedule._internal_losses, "loss")
    for stage in stages:
        for state in stage.backward_state.values():  # (inputs, param_groups, stage_output, output_grads)
            mark([group.get("grads") for group in state[1] or ()], "weight_state")
            mark(state[2], "outputs")
            mark(state[3], "bwd_recv")
    totals = dict.fromkeys(CATEGORIES, 0)
    for key, n_bytes in live.items():
        totals[owner.get(key, "other")] += n_bytes
    return totals


class PipelineTracker(LiveStorageTracker):
    """The live-storage tracker, also splitting each new peak into categories (``classifier``)."""

    def __init__(self, classifier: Callable[[dict[int, int]], dict[str, int]]) -> None:
        super().__init__()
        self.classifier = classifier
        self.peak_categories: dict[str, int] = {}
        self.classify_peaks = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = self.peak_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak_bytes > before and self.classify_peaks:
            self.peak_categories = self.classifier(self._live)
        return out


class _Recorder:
    """Wraps the stages' actions and the schedule's loss and set-up to record each one."""

    def __init__(self, tracker: PipelineTracker, classifier: Callable[[dict[int, int]], dict[str, int]]) -> None:
        self.tracker, self.classifier = tracker, classifier
        self.steps: list[StepRecord] = []

    def _fold_peak(self, step: StepRecord, label: str) -> None:
        if self.tracker.peak_bytes > step.peak_bytes:
            step.peak_bytes, step.peak_action = self.tracker.peak_bytes, label
            step.peak_categories = dict(self.tracker.peak_categories)

    def run(self, kind: str, stage: int, microbatch: int, call: Callable[[], Any]) -> Any:
        step = self.steps[-1]
        self._fold_peak(step, "between actions")
        self.tracker.reset_peak()
        self.tracker.peak_categories = self.classifier(self.tracker._live)
        before = self.tracker.live_bytes
        out = call()
        record = ActionRecord(kind, stage, microbatch, before, self.tracker.peak_bytes, self.tracker.live_bytes,
                              self.classifier(self.tracker._live))
        step.actions.append(record)
        self._fold_peak(step, record.label)
        return out

    def begin_step(self) -> None:
        self.tracker.reset_peak()
        self.steps.append(StepRecord(live_before=self.tracker.live_bytes, peak_bytes=self.tracker.live_bytes,
                                     peak_categories=self.classifier(self.tracker._live)))

    def end_step(self) -> None:
        step = self.steps[-1]
        self._fold_peak(step, "between actions")
        step.live_after, step.categories_after = self.tracker.live_bytes, self.classifier(self.tracker._live)


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
    """``steps`` of ``schedule`` (first stage fed ``ids``, last ``targets``); gradients None between."""
    for index in range(steps):
        tracker.classify_peaks = index == steps - 1
        recorder.begin_step()
        losses: list[torch.Tensor] = []
        schedule.step(*((ids,) if ids is not None else ()), target=targets,
                      losses=losses if targets is not None else None, return_outputs=case.return_outputs)
        del losses
        recorder.end_step()
        for p in params:
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


def in_flight(step: StepRecord) -> list[int]:
    """After each action, the micro-batches whose forward ran and whose activations are still
    held (their full backward, or their backward-weight, has not run yet), over the rank's stages."""
    held: set[tuple[int, int]] = set()
    counts = []
    for action in step.actions:
        if action.kind == "F":
            held.add((action.stage, action.microbatch))
        elif action.kind in ("B", "W"):
            held.discard((action.stage, action.microbatch))
        counts.append(len(held))
    return counts


def format_step(step: StepRecord, shown: tuple[str, ...] = CATEGORIES) -> str:
    """One line per action: label, peak during it, live after, and the non-zero categories."""
    def cats(values: dict[str, int]) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in values.items() if v and k in shown)

    return "\n".join([f"before {step.live_before:>12,}   peak {step.peak_bytes:>12,} at {step.peak_action}: "
                      + cats(step.peak_categories),
                      *(f"{a.label:>10} peak {a.peak_bytes:>12,} after {a.live_after:>12,}  {cats(a.categories)}"
                        for a in step.actions),
                      f"after  {step.live_after:>12,}  " + cats(step.categories_after)])
