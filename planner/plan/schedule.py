"""A step as a schedule of (micro-batch, phase) events: what the memory walk visits in order and
what the time sum adds up.

Plain gradient accumulation is the trivial schedule: ``F0 B0 F1 B1 ... F(A-1) B(A-1) OPT``. Its
micro-batches all have the same shapes, so the walk visits a few representative ones and each
stands for the events it repeats (``Event.repeats``, the weight in the time sum):

- the first micro-batch allocates the parameter gradients (or starts FSDP2's accumulation);
- the second stands for every middle one: the same allocations, gradients already there;
- the last one reduces gradients where only the last one syncs (``sync_last``: FSDP2 with
  ``set_requires_gradient_sync(False)`` on the others); with every micro-batch syncing it
  repeats the second, so it is not walked.

A pipeline schedule (1F1B, interleaved) is another order of the same events, several
micro-batches in flight at once; the walk keeps one state per micro-batch, so it runs them as
listed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"


class BackwardPart(StrEnum):
    """A whole backward, or one half of a split one (torch's ``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT``)."""

    FULL = "full"
    INPUT = "input"  # input gradients only; the graph and each weight op's output gradient kept
    WEIGHT = "weight"  # the weight gradients, then everything the micro-batch kept is freed


@dataclass(frozen=True)
class Event:
    micro_batch: int
    phase: Phase  # FORWARD, BACKWARD (with its recomputation) or OPTIMIZER
    repeats: int = 1  # events of the full schedule this one stands for
    sync: bool = True  # a backward that reduces gradients (DDP's last micro-batch, FSDP2's reduce-scatters)
    stage: int = 0  # which of the rank's pipeline stages runs it (looped schedules hold several)
    part: BackwardPart = BackwardPart.FULL  # a backward split into input and weight gradients (zero bubble)


@dataclass(frozen=True)
class Schedule:
    events: tuple[Event, ...]  # the walked events, in order
    n_micro_batches: int
    sync_last: bool = False  # accumulation where only the last micro-batch syncs gradients
    # a single-stage pipeline schedule (GPipe, 1F1B): a stage input's gradient is held past its
    # backward as the schedule's one pending send (``bwd_sends``), until the stage's next backward
    # has sent its own or the step returns; the runtime schedules drop it once sent
    # (``stage_backward``: ``val.grad = None``). Measured: docs/pipeline_memory.md section 3
    holds_last: bool = False

    def ignoring_sync(self) -> Schedule:
        """The same step for a walk whose allocations do not depend on which backward syncs
        (DDP's resident buckets): the last micro-batch of ``sync_last`` accumulation is the middle
        ones' twin; another order (a pipeline's) keeps its events, every one syncing."""
        if not self.sync_last:
            return self
        if self == accumulation(self.n_micro_batches, sync_last=True):
            return accumulation(self.n_micro_batches)
        return Schedule(events=tuple(replace(e, sync=True) for e in self.events), n_micro_batches=self.n_micro_batches)

    def count(self, phase: Phase, stage: int | None = None) -> int:
        """How many events of ``phase`` the full step has (of one of the rank's stages, if given)."""
        return sum(e.repeats for e in self.events if e.phase is phase and (stage is None or e.stage == stage))

    @property
    def micro_batches(self) -> tuple[int, ...]:
        """The walked micro-batches, in order of their forward."""
        return tuple(e.micro_batch for e in self.events if e.phase is Phase.FORWARD)


def accumulation(n_micro_batches: int, sync_last: bool = False) -> Schedule:
    """The trivial schedule of ``n_micro_batches`` accumulated micro-batches (see the module
    docstring for which are walked). ``sync_last``: only the last micro-batch reduces gradients."""
    n = n_micro_batches
    if n < 1:
        raise ValueError(f"a step needs at least one micro-batch, got {n}")
    if sync_last and n > 2:
        walked = [(0, 1), (1, n - 2), (n - 1, 1)]
    else:
        walked = [(0, 1)] + ([(1, n - 1)] if n > 1 else [])
    events: list[Event] = []
    for mb, repeats in walked:
        sync = not sync_last or mb == n - 1
        events += [Event(mb, Phase.FORWARD, repeats, sync), Event(mb, Phase.BACKWARD, repeats, sync)]
    events.append(Event(n - 1, Phase.OPTIMIZER))
    return Schedule(events=tuple(events), n_micro_batches=n, sync_last=sync_last)
