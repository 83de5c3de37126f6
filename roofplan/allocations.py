"""The memory walk's allocations one by one: every ``Live.add`` of a step's walk, grouped by the
moment (op, phase, micro-batch) it belongs to, for the allocator snapshot (``roofplan.export_snapshot``).

The walk (``planner.memory.step.simulate_step``) keeps live bytes per category and records, with
``record_trace``, only their total after each op. A snapshot needs each allocation and its free,
so this module runs the same walk with a ``Live`` that also logs every change: ``(category,
bytes)``, positive an allocation, negative a free, and each observation point with its momentary
bytes (temporaries and logits that exist only during the op).

The logging ``Live`` is handed to the walk (``StepProgram.walk(live=...)``); the walk is
unchanged: the subclass only appends to a list.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.memory.types import CATEGORIES, Category, Live, Phase
from planner.program.step_program import RankProgram, StepProgram

_GRADS = CATEGORIES.index(Category.GRADS)


@dataclass(frozen=True)
class Moment:
    """An observation point of the walk: the changes since the previous one happened for it."""

    phase: Phase
    op: str
    micro_batch: int
    temporaries_bytes: int  # momentary: allocated and freed within the op
    logits_bytes: int
    event: str  # what happens there when it is not the op itself (an FSDP2 all-gather)
    changes: tuple[tuple[Category, int], ...]  # (category, +allocated / -freed bytes), in order


class _LoggingLive(Live):
    """``Live`` that also logs every change and observation (see the module docstring)."""

    def __init__(self, record_trace: bool = False) -> None:
        super().__init__(record_trace)
        self.changes: list[tuple[Category, int]] = []
        self.moments: list[Moment] = []

    def add(self, category: int, n_bytes: int) -> None:
        super().add(category, n_bytes)
        if n_bytes:
            self.changes.append((CATEGORIES[category], n_bytes))

    def reset_grads(self, n_bytes: int) -> None:
        delta = n_bytes - self.by_category[_GRADS]
        super().reset_grads(n_bytes)
        if delta:
            self.changes.append((Category.GRADS, delta))

    def observe(self, phase: Phase, op: str, temporaries: int = 0, logits: int = 0, event: str = "") -> None:
        super().observe(phase, op, temporaries, logits, event)
        self.moments.append(Moment(phase, op, self.micro_batch, temporaries, logits, event, tuple(self.changes)))
        self.changes = []


def walk_moments(program: StepProgram, rank: RankProgram | None = None) -> tuple[tuple[Moment, ...], int]:
    """``rank``'s walk (default the busiest) as its moments, and its peak allocated bytes; the
    changes after the last moment (the step's end) come as a last moment named ``end of step``."""
    live = _LoggingLive()
    timeline = program.walk(rank=rank, live=live)
    moments = list(live.moments)
    if live.changes:
        moments.append(Moment(Phase.OPTIMIZER, "end of step", live.micro_batch, 0, 0, "", tuple(live.changes)))
    return tuple(moments), timeline.peak.bytes
