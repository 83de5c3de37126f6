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
from dataclasses import dataclass, field
from enum import StrEnum

from planner.cache import IdentityCache
from planner.graph import LOGITS_NODES, LayerGraph
from planner.ops.base import LayerCost


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


@dataclass
class _Live:
    """Live bytes per category, with the peak and where it happened."""

    by_category: dict[Category, int] = field(default_factory=lambda: dict.fromkeys(Category, 0))
    total: int = 0
    peak: PeakPoint | None = None
    micro_batch: int = 0
    trace: list[TraceEvent] | None = None

    def add(self, category: Category, n_bytes: int) -> None:
        self.by_category[category] += n_bytes
        self.total += n_bytes

    def observe(self, phase: Phase, op: str, extra: dict[Category, int] | None = None) -> None:
        """Record a candidate peak: what is live now plus ``extra`` momentary bytes."""
        extra_total = sum(extra.values()) if extra else 0
        total = self.total + extra_total
        if self.trace is not None:
            self.trace.append(TraceEvent(self.micro_batch, phase, op, total))
        if self.peak is None or total > self.peak.bytes:
            breakdown = dict(self.by_category)
            for category, n_bytes in (extra or {}).items():
                breakdown[category] += n_bytes
            self.peak = PeakPoint(total, phase, op, self.micro_batch, breakdown)


@dataclass(frozen=True)
class StaticMemory:
    """Bytes that exist for the whole step (before gradients)."""

    params_bytes: int
    optimizer_bytes: int
    data_bytes: int
    grads_bytes: int  # when all gradients exist
    optimizer_step_temp_bytes: int


@dataclass(frozen=True)
class Timeline:
    peak: PeakPoint
    activations_bytes: int  # saved for backward at the end of one micro-batch's forward, logits excluded
    logits_bytes: int  # logits-family tensors alive at the end of one micro-batch's forward
    recompute_flops: float  # forward FLOPs re-run by checkpointing, per micro-batch
    recomputed_ops: frozenset[str]  # ops whose forward runs again in backward
    trace: tuple[TraceEvent, ...] = ()


def checkpoint_units(n_layers: int, blocks: Sequence[int] | frozenset[int], segments: Sequence[tuple[int, int]] = ()) -> dict[int, int]:
    """Block -> checkpoint unit id. Each block in ``blocks`` is its own unit; a segment
    ``(first, last)`` checkpoints blocks first..last together (Chen et al. 2016)."""
    units: dict[int, int] = {}
    for first, last in segments:
        for block in range(first, last + 1):
            units[block] = first
    for block in blocks:
        units.setdefault(block, block)
    return {b: u for b, u in units.items() if 0 <= b < n_layers}


class _Prepared:
    """Graph facts the walk needs, independent of the checkpoint placement."""

    def __init__(self, graph: LayerGraph, round_bytes: Callable[[int], int]) -> None:
        self.graph = graph
        self.nodes = graph.nodes
        self.position = {name: i for i, name in enumerate(graph.order)}
        n = len(self.nodes)
        self.inputs: list[tuple[int, ...]] = [tuple(self.position[p] for p in op.inputs) for op in self.nodes]
        self.consumers: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (consumer, input position)
        for c, inputs in enumerate(self.inputs):
            for slot, p in enumerate(inputs):
                self.consumers[p].append((c, slot))
        # forward-only users: the op whose completion ends a Python frame holding the tensor
        self.frame_users: list[list[int]] = [[] for _ in range(n)]
        for tensor, until in graph.held_until.items():
            self.frame_users[self.position[tensor]].append(self.position[until])
        self.users_by_op: list[list[int]] = [[] for _ in range(n)]  # op -> tensors it ends a hold on
        for t in range(n):
            for user in [c for c, _ in self.consumers[t]] + self.frame_users[t]:
                self.users_by_op[user].append(t)
        self.out_bytes = [round_bytes(op.cost.output.n_bytes) for op in self.nodes]
        self.out_grad = [op.cost.output.requires_grad and op.cost.has_backward for op in self.nodes]
        self.extras = [sum(round_bytes(b) for b in op.cost.saved_extra_bytes) for op in self.nodes]
        self.copies = [sum(round_bytes(b) for b in op.cost.autocast_copy_bytes) for op in self.nodes]
        self.category = [Category.LOGITS if op.spec.name in LOGITS_NODES else Category.ACTIVATIONS for op in self.nodes]
        self.block = [op.spec.block for op in self.nodes]
        self.params: list[tuple[tuple[str, int], ...]] = [
            tuple((p.name, round_bytes(p.numel * graph.precision.grad_dtype.n_bytes)) for p in op.spec.params)
            for op in self.nodes
        ]


_PREPARED: IdentityCache[_Prepared] = IdentityCache()


def recompute_span(costs: Sequence[LayerCost]) -> tuple[int, int | None]:
    """How much of a checkpoint unit (its ops' costs, in order) the recompute runs.

    Returns (n, final): the first n ops run in full; ``final`` is the index of an op that only
    packs its saved inputs (a trailing matmul, stopped before its kernel), or None. The recompute
    stops once the last op that saves anything has saved it.
    """
    last = 0
    for position, cost in enumerate(costs):
        if cost.saves_output or any(cost.saves_inputs) or cost.saved_extra_bytes or cost.autocast_copy_bytes:
            last = position
    if costs and costs[last].saves_before_compute:
        return last, last
    return last + 1, None


def recomputed_ops(graph: LayerGraph, units: dict[int, int]) -> frozenset[str]:
    """Names of the ops whose forward kernels run again in backward for this placement."""
    members: dict[int, list[int]] = {}
    for block, unit in units.items():
        members.setdefault(unit, []).extend(graph.block_nodes.get(block, ()))
    names: set[str] = set()
    nodes = graph.nodes
    for positions in members.values():
        positions.sort()
        ran, _ = recompute_span([nodes[i].cost for i in positions])
        names.update(graph.order[i] for i in positions[:ran])
    return frozenset(names)


class _Walk:
    """One micro-batch: forward, then backward with recomputation, for a checkpoint placement."""

    def __init__(self, prep: _Prepared, units: dict[int, int], live: _Live, grads_exist: bool) -> None:
        self.p = prep
        self.live = live
        self.grads_exist = grads_exist
        n = len(prep.nodes)
        self.unit = [units.get(b) if b is not None else None for b in prep.block]
        self.alive = [False] * n  # output tensor allocated
        self.holds = [0] * n  # backward users still holding a tensor
        self.release: list[list[int]] = [[] for _ in range(n)]  # node -> tensors it holds
        self.extras_alive = [False] * n
        self.copies_alive = [False] * n
        self.grad_buffer: list[int | None] = [None] * n  # tensor -> gradient buffer id
        self.buffers: dict[int, tuple[int, Category, int]] = {}  # id -> (bytes, category, refcount)
        self.next_buffer = 0
        self.param_grads_seen: set[str] = set()
        self.recompute_flops = 0.0
        self.recomputed: list[int] = []
        self.unit_members: dict[int, list[int]] = {}
        for i, u in enumerate(self.unit):
            if u is not None:
                self.unit_members.setdefault(u, []).append(i)

    # --- tensors ----------------------------------------------------------------------------
    def _hold(self, t: int, users: set[int]) -> None:
        for user in users:
            self.release[user].append(t)
            self.holds[t] += 1

    def _free_tensor(self, t: int) -> None:
        if self.alive[t]:
            self.alive[t] = False
            self.live.add(self.p.category[t], -self.p.out_bytes[t])

    def _backward_users(self, t: int, unit: int | None) -> set[int]:
        """Ops whose backward needs tensor t: savers outside checkpointed units (unit=None), or
        savers inside ``unit`` during its recompute; a checkpointed unit consuming t from outside
        holds it (as a checkpoint input) until the unit's backward ends."""
        p = self.p
        users: set[int] = set()
        if p.nodes[t].cost.saves_output and self.unit[t] == unit:
            users.add(t)
        for node, slot in p.consumers[t]:
            if p.nodes[node].cost.saves_input(slot) and self.unit[node] == unit:
                users.add(node)
            consumer_unit = self.unit[node]
            if unit is None and consumer_unit is not None and self.unit[t] != consumer_unit:
                users.add(self.unit_members[consumer_unit][0])
        return users

    # --- forward ----------------------------------------------------------------------------
    def _run_forward(self, members: list[int], phase: Phase, unit: int | None) -> None:
        p, live = self.p, self.live
        member_set = set(members)
        pending = {
            i: sum(1 for c, _ in p.consumers[i] if c in member_set) + sum(1 for c in p.frame_users[i] if c in member_set)
            for i in members
        }
        for i in members:
            cost = p.nodes[i].cost
            cat = p.category[i]
            live.add(cat, p.out_bytes[i])
            self.alive[i] = True
            if p.copies[i]:
                live.add(Category.TEMPORARIES, p.copies[i])
                self.copies_alive[i] = True
            saving = self.unit[i] is None or unit is not None
            if saving:
                live.add(cat, p.extras[i])
                self.extras_alive[i] = True
                transient = cost.fwd_transient_bytes
            elif cost.unsaved_fwd_transient_bytes is not None:
                transient = cost.unsaved_fwd_transient_bytes
            else:  # checkpointed: the pack hook drops what the op saved once the op returns
                transient = p.extras[i] + cost.fwd_transient_bytes
            live.observe(phase, p.nodes[i].spec.name, {Category.TEMPORARIES: transient})
            self._hold(i, self._backward_users(i, unit))
            if phase is Phase.RECOMPUTE:
                self.recompute_flops += cost.fwd_flops
                self.recomputed.append(i)
            for t in p.users_by_op[i]:
                if t in pending:
                    pending[t] -= 1
                    if pending[t] == 0 and self.holds[t] == 0 and t != len(p.nodes) - 1:
                        self._free_tensor(t)
            if pending[i] == 0 and self.holds[i] == 0 and i != len(p.nodes) - 1:
                self._free_tensor(i)

    def forward(self) -> tuple[int, int]:
        p = self.p
        self._run_forward(list(range(len(p.nodes))), Phase.FORWARD, None)
        # autocast exits: the cached weight copies of checkpointed ops are released
        for i, alive in enumerate(self.copies_alive):
            if alive and self.unit[i] is not None:
                self.copies_alive[i] = False
                self.live.add(Category.TEMPORARIES, -p.copies[i])
        return self.live.by_category[Category.ACTIVATIONS], self.live.by_category[Category.LOGITS]

    # --- backward ---------------------------------------------------------------------------
    def _recompute(self, u: int) -> None:
        """Non-reentrant checkpoint: re-run the unit's forward until every tensor it saved is
        rebuilt (torch raises a stop once the last one is packed). Autograd packs a matmul's
        saved inputs before running it, so a unit ending in a matmul stops short of its kernel:
        only its saves (and any autocast casts, made before the kernel) happen."""
        p = self.p
        members = self.unit_members[u]
        ran, final = recompute_span([p.nodes[i].cost for i in members])
        if final is None:
            self._run_forward(members[:ran], Phase.RECOMPUTE, u)
            return
        self._run_forward(members[:ran], Phase.RECOMPUTE, u)
        final = members[final]
        if p.copies[final]:
            self.live.add(Category.TEMPORARIES, p.copies[final])
            self.copies_alive[final] = True
        self.live.add(p.category[final], p.extras[final])
        self.extras_alive[final] = True
        self.live.observe(Phase.RECOMPUTE, p.nodes[final].spec.name)
        for slot, t in enumerate(p.inputs[final]):
            if p.nodes[final].cost.saves_input(slot):
                self._hold(t, {final})

    def _new_buffer(self, n_bytes: int, category: Category) -> int:
        self.next_buffer += 1
        self.buffers[self.next_buffer] = (n_bytes, category, 1)
        self.live.add(category, n_bytes)
        return self.next_buffer

    def _share_buffer(self, key: int) -> int:
        n_bytes, category, refs = self.buffers[key]
        self.buffers[key] = (n_bytes, category, refs + 1)
        return key

    def _drop_buffer(self, key: int | None) -> None:
        if key is None:
            return
        n_bytes, category, refs = self.buffers[key]
        if refs > 1:
            self.buffers[key] = (n_bytes, category, refs - 1)
        else:
            del self.buffers[key]
            self.live.add(category, -n_bytes)

    def _grad_category(self, t: int) -> Category:
        return Category.LOGITS if self.p.category[t] is Category.LOGITS else Category.TEMPORARIES

    def _param_grads(self, i: int, momentary: dict[Category, int]) -> None:
        """Parameter grads of op i: allocated on first sight, else a transient added in place."""
        for name, n_bytes in self.p.params[i]:
            if self.grads_exist or name in self.param_grads_seen:
                momentary[Category.TEMPORARIES] += n_bytes
            else:
                self.param_grads_seen.add(name)
                self.live.add(Category.GRADS, n_bytes)

    def backward(self) -> None:
        p, live = self.p, self.live
        n = len(p.nodes)
        self.grad_buffer[n - 1] = self._new_buffer(512, Category.LOGITS)  # d loss / d loss
        for i in range(n - 1, -1, -1):
            u = self.unit[i]
            if u is not None and self.unit_members[u][-1] == i:
                self._recompute(u)
            op = p.nodes[i]
            cost = op.cost
            if cost.has_backward and self.grad_buffer[i] is not None:
                momentary = {Category.TEMPORARIES: 0, Category.LOGITS: 0}
                momentary[self._grad_category(i)] += cost.bwd_transient_bytes
                for slot, t in enumerate(p.inputs[i]):
                    if not p.out_grad[t]:
                        continue
                    aliases = cost.grad_aliases_input(slot)
                    if self.grad_buffer[t] is None:
                        own = self.grad_buffer[i]
                        if aliases and own is not None:
                            self.grad_buffer[t] = self._share_buffer(own)
                        else:
                            self.grad_buffer[t] = self._new_buffer(p.out_bytes[t], self._grad_category(t))
                    elif not aliases:
                        momentary[self._grad_category(t)] += p.out_bytes[t]  # accumulated into the buffer
                # under autocast the weight grad is computed in low precision (part of the
                # transient) and cast to the fp32 .grad afterwards, once the op has released
                # what it saved (ToCopyBackward runs after the matmul's backward node)
                cast_later = bool(p.copies[i])
                if not cast_later:
                    self._param_grads(i, momentary)
                live.observe(Phase.BACKWARD, op.spec.name, momentary)
            else:
                cast_later = False
            self._drop_buffer(self.grad_buffer[i])
            self.grad_buffer[i] = None
            for t in self.release[i]:
                self.holds[t] -= 1
                if self.holds[t] == 0:
                    self._free_tensor(t)
            self.release[i] = []
            if self.extras_alive[i]:
                self.extras_alive[i] = False
                live.add(p.category[i], -p.extras[i])
            if self.copies_alive[i]:
                self.copies_alive[i] = False
                live.add(Category.TEMPORARIES, -p.copies[i])
            if cast_later:
                momentary = {Category.TEMPORARIES: p.copies[i]}  # the low-precision weight grad
                self._param_grads(i, momentary)
                live.observe(Phase.BACKWARD, op.spec.name, momentary)
        self._free_tensor(n - 1)
        for key in list(self.buffers):
            self._drop_buffer(key)


def static_memory(
    graph: LayerGraph,
    round_bytes: Callable[[int], int],
    state_tensors_per_param: int,
    step_temporaries_per_param: int,
    device_step_scalar: bool,
    data_sequences: int,
) -> StaticMemory:
    """Parameters, optimizer state, the data batch and the optimizer's step temporaries.

    Each parameter tensor is its own allocation (rounded); optimizer state mirrors every
    parameter tensor in the parameter dtype; the batch is int64 ids and targets for the
    sequences this device holds per step.
    """
    precision = graph.precision
    tensors = graph.param_tensors.values()
    params = sum(round_bytes(n * precision.param_dtype.n_bytes) for n in tensors)
    state_one = sum(round_bytes(n * precision.param_dtype.n_bytes) for n in tensors)
    scalars = round_bytes(4) * len(graph.param_tensors) if device_step_scalar and state_tensors_per_param else 0
    grads = sum(round_bytes(n * precision.grad_dtype.n_bytes) for n in tensors)
    data = 2 * round_bytes(data_sequences * graph.seq_len * 8)
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
    grad_accum_steps: int,
    record_trace: bool = False,
) -> Timeline:
    """Walk one steady-state optimizer step; return its peak and where it happens."""
    prep = _PREPARED.get((graph,), (round_bytes(1),), lambda: _Prepared(graph, round_bytes))
    live = _Live(trace=[] if record_trace else None)
    live.add(Category.PARAMS, static.params_bytes)
    live.add(Category.OPTIMIZER, static.optimizer_bytes)
    live.add(Category.DATA, static.data_bytes)
    live.observe(Phase.FORWARD, "start")
    activations = logits = 0
    recompute = 0.0
    recomputed: frozenset[str] = frozenset()
    for micro_batch in range(min(grad_accum_steps, 2)):  # later micro-batches repeat the second
        live.micro_batch = micro_batch
        walk = _Walk(prep, units, live, grads_exist=micro_batch > 0)
        activations, logits = walk.forward()
        walk.backward()
        recompute = walk.recompute_flops
        recomputed = frozenset(graph.order[i] for i in walk.recomputed)
        if micro_batch == 0:
            live.by_category[Category.GRADS] = 0
            live.total = sum(live.by_category.values())
            live.add(Category.GRADS, static.grads_bytes)
    live.observe(Phase.OPTIMIZER, "optimizer.step", {Category.TEMPORARIES: static.optimizer_step_temp_bytes})
    assert live.peak is not None
    return Timeline(
        peak=live.peak,
        activations_bytes=activations,
        logits_bytes=logits,
        recompute_flops=recompute,
        recomputed_ops=recomputed,
        trace=tuple(live.trace or ()),
    )
