"""Types of the memory timeline: phases, categories, trace events, the peak."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from planner.plan.schedule import Phase


class Category(StrEnum):
    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    DATA = "data"
    ACTIVATIONS = "activations"
    LOGITS = "logits"
    TEMPORARIES = "temporaries"


@dataclass(frozen=True)
class TraceEvent:
    """Live bytes at one observation point of the walk (after an op's allocations)."""

    micro_batch: int
    phase: Phase
    op: str
    live_bytes: int


@dataclass(frozen=True)
class PeakPoint:
    bytes: int
    phase: Phase
    op: str
    micro_batch: int
    breakdown: dict[Category, int]


CATEGORIES: tuple[Category, ...] = tuple(Category)


@dataclass(frozen=True)
class Timeline:
    peak: PeakPoint
    activations_bytes: int  # saved for backward at the end of one micro-batch's forward, logits excluded
    logits_bytes: int  # logits-family tensors alive at the end of one micro-batch's forward
    recompute_flops: float  # forward FLOPs re-run by checkpointing, per micro-batch
    recomputed_ops: frozenset[str]  # ops whose forward runs again in backward
    trace: tuple[TraceEvent, ...] = ()


class Live:
    """Live bytes per category (list index), with the peak and where it happened."""

    def __init__(self, record_trace: bool = False) -> None:
        self.by_category = [0] * len(CATEGORIES)
        self.total = 0
        self.peak: PeakPoint | None = None
        self.peak_bytes = -1
        self.micro_batch = 0
        self.trace: list[TraceEvent] | None = [] if record_trace else None

    def add(self, category: int, n_bytes: int) -> None:
        self.by_category[category] += n_bytes
        self.total += n_bytes

    def reset_grads(self, n_bytes: int) -> None:
        """After the first micro-batch: every parameter gradient exists."""
        grads = CATEGORIES.index(Category.GRADS)
        self.total += n_bytes - self.by_category[grads]
        self.by_category[grads] = n_bytes

    def observe(self, phase: Phase, op: str, temporaries: int = 0, logits: int = 0, event: str = "") -> None:
        """A candidate peak: what is live now plus momentary bytes. ``op`` is the graph node the
        moment belongs to; ``event`` names what happens there when it is not the op itself
        (an FSDP2 all-gather before a block's first op)."""
        total = self.total + temporaries + logits
        if self.trace is not None:
            self.trace.append(TraceEvent(self.micro_batch, phase, op, total))
        if total > self.peak_bytes:
            breakdown = dict(zip(CATEGORIES, self.by_category, strict=True))
            breakdown[Category.TEMPORARIES] += temporaries
            breakdown[Category.LOGITS] += logits
            self.peak_bytes = total
            self.peak = PeakPoint(total, phase, f"{op}: {event}" if event else op, self.micro_batch, breakdown)

    def category_bytes(self, category: Category) -> int:
        return self.by_category[CATEGORIES.index(category)]
