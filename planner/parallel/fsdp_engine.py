"""FSDP2's memory in the step's walk: each rank's static bytes, and the engine whose hooks add
FSDP2's buffers around every unit (the rules of ``planner.parallel.fsdp_units``'s module docstring, measured in
``docs/distributed_memory.md`` section 4 against torch 2.13's ``torch/distributed/fsdp/_fully_shard``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.memory.engine import Accumulate, EngineHooks, StaticMemory
from planner.memory.prepared import Prepared
from planner.memory.types import CATEGORIES, Category, Live, Phase
from planner.memory.walk import Walk
from planner.parallel.fsdp_units import FsdpLayout, ShardUnit
from planner.plan.schedule import Event

_PARAMS = CATEGORIES.index(Category.PARAMS)
_GRADS = CATEGORIES.index(Category.GRADS)
_TEMPORARIES = CATEGORIES.index(Category.TEMPORARIES)


def fsdp_static(layout: FsdpLayout, state_tensors_per_param: int, step_temporaries_per_param: int,
                device_step_scalar: bool, data_bytes: int, round_bytes: Callable[[int], int],
                buffers: int = 0) -> StaticMemory:
    """Rank 0 between steps: padded shards (and the model's whole buffers), optimizer state of its
    (largest) local shards, batch."""
    shards = sum(u.sharded_bytes for u in layout.units)
    n_tensors = sum(len(u.params) for u in layout.units)
    scalars = round_bytes(4) * n_tensors if device_step_scalar and state_tensors_per_param else 0
    return StaticMemory(
        params_bytes=shards + buffers,
        optimizer_bytes=state_tensors_per_param * shards + scalars,
        data_bytes=data_bytes,
        grads_bytes=sum(u.sharded_grad_bytes for u in layout.units),
        optimizer_step_temp_bytes=step_temporaries_per_param * shards,
        engine=FsdpEngine(layout),
    )


@dataclass(frozen=True)
class FsdpEngine(Accumulate):
    """FSDP2's memory in the step's walk: gathers, copy-outs and reduce-scatters around each unit."""

    layout: FsdpLayout | None = None
    memory_depends_on_sync = True  # a backward without sync keeps its unsharded gradients

    def hooks(self, prep: Prepared, static: StaticMemory, stage: int = 0) -> EngineHooks:
        assert self.layout is not None
        return FsdpHooks(self.layout, prep, static)


class FsdpHooks(EngineHooks):
    """FSDP2's buffers around the walk of one step (the object lives across micro-batches)."""

    reshards_after_backward = True  # a unit's post-backward frees its gathered parameters

    def __init__(self, layout: FsdpLayout, prep: Prepared, static: StaticMemory) -> None:
        super().__init__(prep, static)
        self.layout = layout
        self.stage3 = layout.stage == 3
        self.names = prep.names
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        units = {u.name: u for u in layout.units}
        for position, (name, block) in enumerate(zip(prep.names, prep.block, strict=True)):
            if block is None:
                continue
            for unit in (f"blocks.{block}", f"blocks.{block}.mlp.experts"):
                if unit in units and (name.startswith(unit + ".") or unit == f"blocks.{block}"):
                    first.setdefault(unit, position)
                    last[unit] = position
        self.entry: dict[int, list[ShardUnit]] = {}  # a unit's first op (its pre-forward, its post-backward)
        self.exit: dict[int, list[ShardUnit]] = {}  # its last op (its post-forward, its pre-backward)
        for unit, position in first.items():
            self.entry.setdefault(position, []).append(units[unit])
        for unit, position in last.items():
            self.exit.setdefault(position, []).append(units[unit])
        # FSDP2 prefetches in the reverse of the post-forward order
        self.backward_order = [units[u] for u in sorted(last, key=lambda u: -last[u])]
        self.next_in_backward = dict(zip((u.name for u in self.backward_order), self.backward_order[1:], strict=False))
        self.reduced: set[str] = set()  # units whose sharded gradient exists
        self.sync = True  # this micro-batch reduce-scatters (GradSync.LAST: only the last one)
        self.held: dict[str, int] = {}  # unit -> bytes of unsharded gradients kept across micro-batches
        self.held_gather = 0  # forward: the previous unit's all-gather output
        self.held_reduce = 0  # the previous unit's reduce-scatter input
        self.held_all_reduce = 0  # HSDP: accumulated reduce-scatter outputs held until finalize_backward
        self.prefetched: dict[str, int] = {}  # unit -> its all-gather output, gathered ahead
        self.copied: set[str] = set()  # nested units a checkpoint's recompute copied out this backward
        self.recompute_gather: dict[str, int] = {}  # their gather output, kept until their post-forward

    @property
    def held_params(self) -> frozenset[str]:
        """Parameters whose unsharded ``.grad`` a previous micro-batch left allocated (no upcast:
        under a policy the kept copies are FSDP2's, not the parameters' gradients)."""
        if self.layout.upcasts_grads:
            return frozenset()
        return frozenset(p for u in self.layout.units if u.name in self.held for p in u.params)

    # --- the step's events ------------------------------------------------------------------------
    def new_walk(self, units: dict[int, int], live: Live, event: Event) -> Walk:
        """Gradients are allocated afresh by each micro-batch and freed at each unit's
        post-backward, except the unsharded ones a micro-batch without sync left allocated."""
        self.sync = event.sync
        return Walk(self.prep, units, live, grads_exist=False, hooks=self, unit_grads=True,
                    held_grads=self.held_params)

    def before_backward_event(self, walk: Walk, event: Event) -> None:
        self.sync = event.sync

    def after_backward_event(self, walk: Walk, event: Event) -> None:
        pass

    # --- around the ops -----------------------------------------------------------------------------
    def _all_gather(self, live: Live, unit: ShardUnit, phase: Phase, op: str) -> int:
        live.add(_TEMPORARIES, unit.gather_input_bytes + unit.gather_output_bytes)
        live.observe(phase, op, event=f"all-gather {unit.name}")
        live.add(_TEMPORARIES, -unit.gather_input_bytes)
        return unit.gather_output_bytes

    def _copy_out(self, live: Live, unit: ShardUnit, phase: Phase, op: str) -> None:
        live.add(_PARAMS, unit.unsharded_bytes)
        live.add(_TEMPORARIES, unit.reordered_bytes)
        live.observe(phase, op, event=f"copy-out {unit.name}")
        live.add(_TEMPORARIES, -unit.reordered_bytes)

    def _unshard(self, live: Live, unit: ShardUnit, phase: Phase, op: str) -> None:
        """All-gather and copy-out while the previous unit's all-gather output is still held."""
        gathered = self._all_gather(live, unit, phase, op)
        self._copy_out(live, unit, phase, op)
        live.add(_TEMPORARIES, -self.held_gather)
        self.held_gather = gathered

    def _post_backward(self, walk: Walk, unit: ShardUnit, op: str) -> None:
        live = walk.live
        held = self.held.pop(unit.name, 0)
        if held and self.layout.upcasts_grads:  # accumulate_unsharded_grad_if_needed: += and free
            walk.release_grads(unit.params)
        if not self.sync:
            self._keep_grads(walk, unit, op, held)
            return
        live.add(_PARAMS, -unit.unsharded_bytes)
        live.add(_TEMPORARIES, unit.reduce_input_bytes - self.held_reduce)
        self.held_reduce = unit.reduce_input_bytes
        live.add(_TEMPORARIES, unit.reordered_grad_bytes)
        live.observe(Phase.BACKWARD, op, event=f"reduce-scatter {unit.name}")
        walk.release_grads(unit.params)
        last = unit.last_grad_bytes
        if held:  # the kept gradients are the reduce-scatter's input, freed like autograd's
            live.add(_GRADS, -held)
            last = unit.last_accumulated_bytes if self.layout.upcasts_grads else unit.last_grad_bytes
        # the copies die with foreach_reduce's list (cleared after the copy-in), before the
        # output is allocated; the last original gradient is still referenced then
        live.add(_TEMPORARIES, -unit.reordered_grad_bytes)
        live.add(_GRADS, last + unit.sharded_grad_bytes)
        live.observe(Phase.BACKWARD, op, event=f"reduce-scatter output {unit.name}")
        live.add(_GRADS, -last)
        if unit.name in self.reduced and self.layout.replicas > 1:
            # HSDP all-reduces the reduce-scatter output in place across the replicas and keeps it
            # in ``FSDPParamGroup._all_reduce_state`` until ``finalize_backward`` (the root's final
            # callback), though it was added into the existing sharded gradient (torch 2.13
            # ``foreach_reduce``; PR #140044): held past every later unit's post-backward
            self.held_all_reduce += unit.sharded_grad_bytes
        elif unit.name in self.reduced:  # added into the existing sharded gradient
            live.add(_GRADS, -unit.sharded_grad_bytes)
        self.reduced.add(unit.name)

    def _keep_grads(self, walk: Walk, unit: ShardUnit, op: str, held: int) -> None:
        """Post-backward without gradient sync: reshard, then keep the unsharded gradients, cast
        up to the reduce dtype one parameter at a time under a MixedPrecisionPolicy
        (``to_accumulated_grad_if_needed``), else as the parameters' ``.grad``."""
        live = walk.live
        if self.reshards_after_backward:
            live.add(_PARAMS, -unit.unsharded_bytes)
        if held:
            self.held[unit.name] = held
            return
        if self.layout.upcasts_grads:
            walk.release_grads(unit.params)
            live.add(_GRADS, unit.upcast_peak_bytes)
            live.observe(Phase.BACKWARD, op, event=f"gradients of {unit.name} cast to the reduce dtype")
            live.add(_GRADS, unit.accumulated_bytes - unit.upcast_peak_bytes)
            self.held[unit.name] = unit.accumulated_bytes
        else:
            self.held[unit.name] = sum(walk.grad_bytes.pop(name, 0) for name in unit.params)

    # --- forward --------------------------------------------------------------------------------
    def forward_start(self, walk: Walk) -> None:
        self.held_gather = 0
        self._unshard(walk.live, self.layout.root, Phase.FORWARD, self.names[0])

    def before_forward(self, walk: Walk, op: int) -> None:
        for unit in self.entry.get(op, ()):
            self._unshard(walk.live, unit, Phase.FORWARD, self.names[op])

    def after_forward(self, walk: Walk, op: int) -> None:
        if self.stage3:
            for unit in self.exit.get(op, ()):
                walk.live.add(_PARAMS, -unit.unsharded_bytes)

    def forward_end(self, walk: Walk) -> None:
        walk.live.add(_TEMPORARIES, -self.held_gather)
        self.held_gather = 0
        if self.stage3:
            walk.live.add(_PARAMS, -self.layout.root.unsharded_bytes)

    # --- backward -------------------------------------------------------------------------------
    def _prefetch(self, live: Live, unit: ShardUnit | None, op: str) -> None:
        if unit is not None:
            self.prefetched[unit.name] = self._all_gather(live, unit, Phase.BACKWARD, op)

    def backward_start(self, walk: Walk) -> None:
        self.copied.clear()
        if not self.stage3:
            return
        live, op, root = walk.live, self.names[-1], self.layout.root
        gathered = self._all_gather(live, root, Phase.BACKWARD, op)
        self._copy_out(live, root, Phase.BACKWARD, op)
        live.add(_TEMPORARIES, -gathered)  # freed as wait_for_unshard returns (not in the forward)
        self._prefetch(live, self.backward_order[0] if self.backward_order else None, op)

    def before_recompute(self, walk: Walk, op: int) -> None:
        """A checkpoint's recompute runs a nested unit's forward before its pre-backward (its
        output's gradient comes later): FSDP2's pre-forward copies the prefetched gather out then,
        in the FORWARD state, so the gather output is kept (``comm_ctx.all_gather_state``) until
        that forward's root post-forward (torch 2.13 ``FSDPParamGroup.wait_for_unshard``,
        ``FSDPState._post_forward``: the unit is its own forward root during a recompute)."""
        if not self.stage3:
            return
        for unit in self.entry.get(op, ()):
            if unit.nested and unit.name not in self.copied:
                live = walk.live
                gathered = self.prefetched.pop(unit.name, None)
                if gathered is None:
                    gathered = self._all_gather(live, unit, Phase.RECOMPUTE, self.names[op])
                self._copy_out(live, unit, Phase.RECOMPUTE, self.names[op])
                self.recompute_gather[unit.name] = gathered
                self.copied.add(unit.name)

    def after_recompute(self, walk: Walk, op: int) -> None:
        """The nested unit's post-forward in a recompute frees the gather output it kept."""
        for unit in self.exit.get(op, ()):
            walk.live.add(_TEMPORARIES, -self.recompute_gather.pop(unit.name, 0))

    def before_backward(self, walk: Walk, op: int) -> None:
        if not self.stage3:
            return
        live, name = walk.live, self.names[op]
        for unit in self.exit.get(op, ()):
            if unit.name not in self.copied:
                self._copy_out(live, unit, Phase.BACKWARD, name)
                live.add(_TEMPORARIES, -self.prefetched.pop(unit.name, 0))
            self._prefetch(live, self.next_in_backward.get(unit.name), name)

    def after_backward(self, walk: Walk, op: int) -> None:
        for unit in self.entry.get(op, ()):
            self._post_backward(walk, unit, self.names[op])

    def backward_end(self, walk: Walk) -> None:
        self._post_backward(walk, self.layout.root, self.names[0])
        walk.live.add(_TEMPORARIES, -self.held_reduce)
        walk.live.add(_GRADS, -self.held_all_reduce)  # finalize_backward drops every unit's
        self.held_reduce = self.held_all_reduce = 0
