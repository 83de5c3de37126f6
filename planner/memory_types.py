"""Types of the memory timeline: phases, categories, trace events, the peak."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"


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
