"""The memory timeline: one steady-state optimizer step walked op by op, as autograd allocates.

Static: parameters, optimizer state (created by step 1, so present in the steady state), the
data batch. Per micro-batch, forward: each op allocates its output; a tensor stays alive while a
later op still needs it in the forward or while some op saved it for backward; extras an op
saves (statistics, masks, copies) live until its backward. A checkpointed unit keeps only its
inputs; what its ops saved is dropped and rebuilt just before the unit's backward. Backward in
reverse: input gradients are allocated (or accumulated into an existing buffer), the output
gradient is freed, saved tensors are freed once their last user has run, parameter gradients
appear on the first micro-batch and persist. The optimizer step adds its temporaries, then
``zero_grad(set_to_none=True)`` frees the gradients.

Every tensor is rounded to the allocator's granularity (512 B on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planner.cache import IdentityCache
from planner.graph.layer_graph import LayerGraph
from planner.memory.engine import StaticMemory
from planner.memory.prepared import Prepared, recompute_span
from planner.memory.types import Category, Live, PeakPoint, Phase, Timeline, TraceEvent
from planner.memory.walk import Walk
from planner.plan.checkpointing import TORCHTITAN_SAVE_LIST, CheckpointPolicy, CheckpointUnits, SaveList, op_units
from planner.plan.schedule import Schedule

_PREPARED: IdentityCache[Prepared] = IdentityCache()


__all__ = [
    "Category",
    "PeakPoint",
    "Phase",
    "StaticMemory",
    "Timeline",
    "TraceEvent",
    "checkpoint_units",
    "recompute_span",
    "recomputed_by_unit",
    "recomputed_ops",
    "simulate_step",
    "static_memory",
]


def checkpoint_units(n_layers: int, blocks: Sequence[int] | frozenset[int], segments: Sequence[tuple[int, int]] = (),
                     policy: CheckpointPolicy = CheckpointPolicy.FULL,
                     save: SaveList = TORCHTITAN_SAVE_LIST,
                     overrides: dict[int, CheckpointPolicy] | None = None) -> CheckpointUnits:
    """Block -> checkpoint unit id. Each block in ``blocks`` is its own unit, checkpointed with
    ``policy`` (``planner.plan.checkpointing``) unless ``overrides`` names another for it; a segment
    ``(first, last)`` checkpoints blocks first..last together (Chen et al. 2016)."""
    units: dict[int, int] = {}
    for first, last in segments:
        for block in range(first, last + 1):
            units[block] = first
    for block in blocks:
        units.setdefault(block, block)
    return CheckpointUnits({b: u for b, u in units.items() if 0 <= b < n_layers}, policy, save, overrides)


def recomputed_ops(graph: LayerGraph, units: dict[int, int]) -> frozenset[str]:
    """Names of the ops whose forward kernels run again in backward for this placement (under
    per-op selective checkpointing, not the ops whose outputs were kept)."""
    return frozenset().union(*recomputed_by_unit(graph, units).values())


def recomputed_by_unit(graph: LayerGraph, units: dict[int, int]) -> dict[int, frozenset[str]]:
    """Checkpoint unit -> the names of its ops that run again in backward."""
    nodes = graph.nodes
    unit, cached = op_units([op.spec.kind for op in nodes], [op.spec.block for op in nodes],
                            [op.spec.bias for op in nodes], units)
    members: dict[int, list[int]] = {}
    for position, u in enumerate(unit):
        if u is not None:
            members.setdefault(u, []).append(position)
    out = {}
    for u, positions in members.items():
        ran, _ = recompute_span([nodes[i].cost for i in positions])
        out[u] = frozenset(graph.order[i] for i in positions[:ran] if not cached[i])
    return out


def buffer_bytes(graph: LayerGraph, round_bytes: Callable[[int], int]) -> int:
    """The model's buffers (``LayerGraph.buffer_bytes``), each its own allocation."""
    return sum(round_bytes(n) for n in graph.buffer_bytes)


def static_memory(
    graph: LayerGraph,
    round_bytes: Callable[[int], int],
    state_tensors_per_param: int,
    step_temporaries_per_param: int,
    device_step_scalar: bool,
    data_sequences: int,
    data_seq_len: int | None = None,
) -> StaticMemory:
    """Parameters, optimizer state, the data batch and the optimizer's step temporaries.

    Each parameter tensor is its own allocation (rounded), and so is each buffer (counted with the
    parameters); optimizer state mirrors every parameter tensor in the parameter dtype; the batch is int64 ids and targets for the
    sequences this device holds per step, ``data_seq_len`` tokens each (default the graph's).
    """
    precision = graph.precision
    tensors = graph.param_tensors.values()
    params = sum(round_bytes(n * precision.param_dtype.n_bytes) for n in tensors) + buffer_bytes(graph, round_bytes)
    state_one = sum(round_bytes(n * precision.param_dtype.n_bytes) for n in tensors)
    scalars = round_bytes(4) * len(graph.param_tensors) if device_step_scalar and state_tensors_per_param else 0
    grads = sum(round_bytes(n * precision.grad_dtype.n_bytes) for n in graph.grad_tensors.values())
    data = 2 * round_bytes(data_sequences * (data_seq_len or graph.seq_len) * 8)
    return StaticMemory(
        params_bytes=params,
        optimizer_bytes=state_tensors_per_param * state_one + scalars,
        data_bytes=data,
        grads_bytes=grads,
        optimizer_step_temp_bytes=step_temporaries_per_param * state_one,
    )


def simulate_step(
    graph: LayerGraph,
    static: StaticMemory,
    round_bytes: Callable[[int], int],
    units: dict[int, int],
    schedule: Schedule,
    record_trace: bool = False,
) -> Timeline:
    """Walk one steady-state step of a rank, event by event of its schedule; return its peak and
    where it happens. The one event loop of every strategy: the rank's engine
    (``static.engine``, ``planner.memory.engine``) says what exists from the start and adds its buffers
    through its hooks; the schedule says which micro-batch runs which phase, several of them in
    flight at once where it interleaves them."""
    prep = _PREPARED.get((graph,), (round_bytes(1),), lambda: Prepared(graph, round_bytes))
    engine = static.engine
    events = schedule.events if engine.memory_depends_on_sync else schedule.ignoring_sync().events
    live = Live(record_trace)
    hooks = engine.hooks(prep, static)
    hooks.start_step(live)
    live.observe(Phase.FORWARD, "start")
    activations = logits = 0
    walks: dict[int, Walk] = {}
    walk: Walk | None = None
    for event in events:
        live.micro_batch = event.micro_batch
        if event.phase is Phase.FORWARD:
            walk = walks[event.micro_batch] = hooks.new_walk(units, live, event)
            activations, logits = walk.forward()
        elif event.phase is Phase.BACKWARD:
            walk = walks.pop(event.micro_batch)
            hooks.before_backward_event(walk, event)
            walk.backward()
            hooks.after_backward_event(walk, event)
        else:
            live.observe(Phase.OPTIMIZER, "optimizer.step", static.optimizer_step_temp_bytes)
    assert live.peak is not None and walk is not None
    return Timeline(
        peak=live.peak,
        activations_bytes=activations,
        logits_bytes=logits,
        recompute_flops=walk.recompute_flops,
        recomputed_ops=frozenset(graph.order[i] for i in walk.recomputed),
        trace=tuple(live.trace or ()),
    )
