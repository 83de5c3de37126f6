"""What one pipeline rank's run is recorded as (``validate.pipeline``): each action (forward, loss,
backward or its halves, the schedule's set-up, the optimizer step) with its peak and the live bytes
after it, split by what holds each storage (``CATEGORIES``); the tracker and the recorder the
harness runs them with. The optimizer's state counts as "other"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from validate.tracker import LiveStorageTracker

CATEGORIES = ("params", "grads", "batch", "fwd_recv", "bwd_recv", "outputs", "input_grads", "loss",
              "weight_state", "other")


@dataclass
class ActionRecord:
    """One action of the rank: ``kind`` F/L/B/I/W (or "init": the schedule's stage set-up; "OPT",
    stage -1: the optimizer step after ``schedule.step``; FSDP2's UNSHARD/RESHARD/REDUCE_GRAD)."""

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
        if self.stage < 0:  # the rank's own (the optimizer step)
            return self.kind
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

