"""Types of the memory timeline: phases, categories, trace events, the peak."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.fsdp import FsdpLayout


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


@dataclass(frozen=True)
class StaticMemory:
    """Bytes that exist for the whole step (before gradients)."""

    params_bytes: int
    optimizer_bytes: int
    data_bytes: int
    grads_bytes: int  # when all gradients exist
    optimizer_step_temp_bytes: int
    grads_resident: bool = False  # DDP's gradient buckets: allocated once, alive for the whole step
    sharding: FsdpLayout | None = None  # FSDP2 (ZeRO-2/3): the walk adds its gathers and reduce-scatters


@dataclass(frozen=True)
class Timeline:
    peak: PeakPoint
    activations_bytes: int  # saved for backward at the end of one micro-batch's forward, logits excluded
    logits_bytes: int  # logits-family tensors alive at the end of one micro-batch's forward
    recompute_flops: float  # forward FLOPs re-run by checkpointing, per micro-batch
    recomputed_ops: frozenset[str]  # ops whose forward runs again in backward
    trace: tuple[TraceEvent, ...] = ()
