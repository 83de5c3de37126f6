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
from dataclasses import replace

from planner.cache import IdentityCache
from planner.graph.layer_graph import LayerGraph
from planner.memory.engine import StaticMemory
from planner.memory.prepared import Prepared, recompute_span
from planner.memory.types import Category, Live, PeakPoint, Phase, Timeline, TraceEvent
from planner.memory.walk import Walk
from planner.plan.checkpointing import TORCHTITAN_SAVE_LIST, CheckpointPolicy, CheckpointUnits, SaveList, op_units
from planner.plan.schedule import BackwardPart, Schedule

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


def grads_bytes_of(graph: LayerGraph, round_bytes: Callable[[int], int]) -> int:
    """Every parameter gradient of ``graph``, each its own allocation."""
    return sum(round_bytes(n * graph.precision.grad_dtype.n_bytes) for n in graph.grad_tensors.values())


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
    trained = graph.trainable_tensors  # frozen parameters (a fine-tuning plan's base) have no state
    state_one = sum(round_bytes(n * precision.param_dtype.n_bytes) for n in trained.values())
    scalars = round_bytes(4) * len(trained) if device_step_scalar and state_tensors_per_param else 0
    grads = grads_bytes_of(graph, round_bytes)
    data = 2 * round_bytes(data_sequences * (data_seq_len or graph.seq_len) * 8)
    return StaticMemory(
        params_bytes=params,
        optimizer_bytes=state_tensors_per_param * state_one + scalars,
        data_bytes=data,
        grads_bytes=grads,
        optimizer_step_temp_bytes=step_temporaries_per_param * state_one,
    )


def _prepared(graph: LayerGraph, round_bytes: Callable[[int], int]) -> Prepared:
    return _PREPARED.get((graph,), (round_bytes(1),), lambda: Prepared(graph, round_bytes))


def simulate_step(
    graph: LayerGraph,
    static: StaticMemory,
    round_bytes: Callable[[int], int],
    units: dict[int, int],
    schedule: Schedule,
    record_trace: bool = False,
    others: Sequence[LayerGraph] = (),
    live: Live | None = None,
) -> Timeline:
    """Walk one steady-state step of a rank, event by event of its schedule; return its peak and
    where it happens. The one event loop of every strategy: the rank's engine
    (``static.engine``, ``planner.memory.engine``) says what exists from the start and adds its buffers
    through its hooks; the schedule says which micro-batch runs which phase, several of them in
    flight at once where it interleaves them. A rank of a looped pipeline schedule holds several
    stages: ``graph`` and ``others``, each event naming its stage (``Event.stage``); ``static``
    is then all of them together. ``live``: the live-bytes record to walk into (a subclass can log
    every allocation: the allocator snapshot's exporter); a new one by default."""
    graphs = (graph, *others)
    preps = [_prepared(g, round_bytes) for g in graphs]
    engine = static.engine
    events = schedule.events if engine.memory_depends_on_sync else schedule.ignoring_sync().events
    live = live if live is not None else Live(record_trace)
    # each stage's hooks know its own gradients; what the rank holds from the start is added once
    hooks = [engine.hooks(prep, replace(static, grads_bytes=grads_bytes_of(g, round_bytes)) if others else static, i)
             for i, (prep, g) in enumerate(zip(preps, graphs, strict=True))]
    engine.hooks(preps[0], static).start_step(live)
    live.observe(Phase.FORWARD, "start")
    activations = logits = 0
    walks: dict[tuple[int, int], Walk] = {}
    last: dict[int, Walk] = {}  # each stage's latest walk
    sending: dict[int, Walk] = {}  # each stage's pending send of its input's gradient (``holds_last``)
    for event in events:
        live.micro_batch = event.micro_batch
        key, stage_hooks = (event.stage, event.micro_batch), hooks[event.stage]
        if event.phase is Phase.FORWARD:
            walk = walks[key] = last[event.stage] = stage_hooks.new_walk(units, live, event)
            activations, logits = walk.forward()
        elif event.phase is Phase.BACKWARD and event.part is BackwardPart.INPUT:
            walks[key].backward(input_only=True)  # kept until its weight half
        elif event.phase is Phase.BACKWARD:
            walk = last[event.stage] = walks.pop(key)
            stage_hooks.before_backward_event(walk, event)
            if event.part is BackwardPart.WEIGHT:
                walk.backward_weight()
            else:
                walk.backward(keep_sent=schedule.holds_last)
                if schedule.holds_last:  # one pending send: this one replaces the previous
                    if event.stage in sending:
                        sending[event.stage].release_kept()
                    sending[event.stage] = walk
            stage_hooks.after_backward_event(walk, event)
        else:
            for walk in sending.values():  # the schedule's step returned: its locals are gone
                walk.release_kept()
            live.observe(Phase.OPTIMIZER, "optimizer.step", static.optimizer_step_temp_bytes)
    assert live.peak is not None and last
    return Timeline(
        peak=live.peak,
        activations_bytes=activations,
        logits_bytes=logits,
        recompute_flops=sum(w.recompute_flops for w in last.values()),
        recomputed_ops=frozenset(graphs[s].order[i] for s, w in last.items() for i in w.recomputed),
        trace=tuple(live.trace or ()),
    )
