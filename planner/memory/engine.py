"""How a data-parallel engine's memory joins the walk of a step: which bytes exist from the start,
whether parameter gradients are there before a micro-batch's backward, and the buffers its hooks
add around each op (``planner.memory.walk.WalkHooks``).

The step's one event loop (``planner.memory.step.simulate_step``) asks the rank's engine for each of
these; it never branches on a strategy. Three engines exist:

- ``Accumulate`` (one GPU): gradients appear in the first micro-batch's backward and are added
  into in place by the later ones (``zero_grad(set_to_none=True)`` after the step frees them);
- ``ResidentGradients`` (DDP, ZeRO-1): ``gradient_as_bucket_view=True`` keeps every gradient in
  DDP's buckets, allocated once, for the whole step;
- ``planner.parallel.fsdp_engine.FsdpEngine`` (ZeRO-2/3): each unit's gradients appear in its backward and are
  reduce-scattered and freed at its post-backward; the sharded gradients persist (under a
  pipeline, ``planner.parallel.fsdp_pipeline.PipelinedFsdpEngine``: kept unsharded until one
  reduce-scatter after the stage's last backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.memory.prepared import Prepared
from planner.memory.types import CATEGORIES, Category, Live
from planner.memory.walk import Walk, WalkHooks
from planner.plan.schedule import Event

_PARAMS, _GRADS, _OPTIMIZER, _DATA, _ACTIVATIONS = (
    CATEGORIES.index(c) for c in (Category.PARAMS, Category.GRADS, Category.OPTIMIZER, Category.DATA, Category.ACTIVATIONS))


class EngineHooks(WalkHooks):
    """One walk of a step under an engine (the object lives across its micro-batches)."""

    def __init__(self, prep: Prepared, static: StaticMemory) -> None:
        self.prep = prep
        self.static = static
        self.backwards_done = 0  # micro-batches whose backward has run (several may be in flight)
        self.grads_before = 0  # gradients other stages of the rank already hold when this one's first backward runs

    def start_step(self, live: Live) -> None:
        """The bytes that exist before the step's first event."""
        live.add(_PARAMS, self.static.params_bytes)
        live.add(_OPTIMIZER, self.static.optimizer_bytes)
        live.add(_DATA, self.static.data_bytes)
        live.add(_ACTIVATIONS, self.static.received_bytes)

    def new_walk(self, units: dict[int, int], live: Live, event: Event) -> Walk:
        """The walk of ``event``'s micro-batch (its forward)."""
        return Walk(self.prep, units, live, grads_exist=False, hooks=self)

    def before_backward_event(self, walk: Walk, event: Event) -> None:
        """A micro-batch's backward is about to run: it adds into the gradients an earlier backward
        allocated (whichever micro-batch that was: a pipeline runs several forwards first)."""
        walk.grads_exist = self.backwards_done > 0
        if not self.backwards_done:
            self.grads_before = walk.live.by_category[_GRADS]

    def after_backward_event(self, walk: Walk, event: Event) -> None:
        """A micro-batch's backward ran: after the first, every parameter gradient exists."""
        if not self.backwards_done:
            walk.live.reset_grads(self.grads_before + self.static.grads_bytes)
        self.backwards_done += 1


@dataclass(frozen=True)
class Accumulate:
    """One GPU: gradients accumulated in place across micro-batches."""

    memory_depends_on_sync = False  # whether a backward that syncs gradients allocates otherwise
    grads_resident = False  # every gradient exists for the whole step

    def hooks(self, prep: Prepared, static: StaticMemory, stage: int = 0) -> EngineHooks:
        """The hooks of one walk of a step, for the rank's ``stage``-th pipeline stage (0 without one)."""
        return EngineHooks(prep, static)

    def joined(self, others: Sequence[Accumulate]) -> Accumulate:
        """The engine of a rank holding several pipeline stages: this stage's and ``others``'
        (engines that keep per-stage state, FSDP2's under a pipeline, hold every stage's)."""
        return self


class _ResidentHooks(EngineHooks):
    def start_step(self, live: Live) -> None:
        super().start_step(live)
        live.add(_GRADS, self.static.grads_bytes)

    def new_walk(self, units: dict[int, int], live: Live, event: Event) -> Walk:
        return Walk(self.prep, units, live, grads_exist=True, hooks=self)

    def before_backward_event(self, walk: Walk, event: Event) -> None:
        pass

    def after_backward_event(self, walk: Walk, event: Event) -> None:
        pass


@dataclass(frozen=True)
class ResidentGradients(Accumulate):
    """DDP's gradient buckets: every gradient allocated once, alive for the whole step."""

    grads_resident = True

    def hooks(self, prep: Prepared, static: StaticMemory, stage: int = 0) -> EngineHooks:
        return _ResidentHooks(prep, static)


@dataclass(frozen=True)
class StaticMemory:
    """A rank's bytes that exist for the whole step (before gradients), and the engine whose
    hooks add its buffers to the walk (``Accumulate``, ``ResidentGradients``, FSDP2's)."""

    params_bytes: int
    optimizer_bytes: int
    data_bytes: int
    grads_bytes: int  # when all gradients exist
    optimizer_step_temp_bytes: int
    engine: Accumulate = field(default_factory=Accumulate)
    received_bytes: int = 0  # a pipeline stage's receive buffers (activations and gradients), held for the step

    @property
    def grads_resident(self) -> bool:
        return self.engine.grads_resident
