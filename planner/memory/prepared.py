"""What the memory walk needs to know of a graph, computed once per graph (independent of the
checkpoint placement): per-op facts as plain lists, so the walk's hot loop indexes lists
(``planner.memory.walk``), and how much of a checkpoint unit a recompute runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planner.graph.layer_graph import LOGITS_NODES, LayerGraph
from planner.memory.types import CATEGORIES, Category
from planner.ops.base import LayerCost

_ACTIVATIONS, _LOGITS, _TEMPORARIES = (CATEGORIES.index(c) for c in (Category.ACTIVATIONS, Category.LOGITS,
                                                                   Category.TEMPORARIES))


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


class Prepared:
    """Graph facts the walk needs, independent of the checkpoint placement."""

    def __init__(self, graph: LayerGraph, round_bytes: Callable[[int], int]) -> None:
        self.graph = graph
        nodes = graph.nodes
        self.nodes = nodes
        self.names = list(graph.order)
        position = {name: i for i, name in enumerate(graph.order)}
        n = self.n = len(nodes)
        self.inputs: list[tuple[int, ...]] = [tuple(position[p] for p in op.inputs) for op in nodes]
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        self.savers: list[list[int]] = [[] for _ in range(n)]  # ops whose backward needs tensor t
        for c, inputs in enumerate(self.inputs):
            for slot, p in enumerate(inputs):
                self.consumers[p].append(c)
                if nodes[c].cost.saves_input(slot):
                    self.savers[p].append(c)
        for t, op in enumerate(nodes):
            if op.cost.saves_output:
                self.savers[t].append(t)
        # forward-only users: the op whose completion ends a Python frame holding the tensor
        self.frame_users: list[list[int]] = [[] for _ in range(n)]
        for tensor, until in graph.held_until.items():
            self.frame_users[position[tensor]].append(position[until])
        self.users_by_op: list[list[int]] = [[] for _ in range(n)]  # op -> tensors it ends a hold on
        for t in range(n):
            for user in self.consumers[t] + self.frame_users[t]:
                self.users_by_op[user].append(t)
        # a view (``output_is_view``) allocates nothing and keeps its base (first input) alive;
        # its gradient is still a tensor of its own size
        self.view_of: list[int | None] = [self.inputs[i][0] if op.cost.output_is_view else None
                                          for i, op in enumerate(nodes)]
        self.grad_size = [round_bytes(op.cost.output.n_bytes) for op in nodes]
        self.out_bytes = [0 if base is not None or op.cost.output_preallocated else size
                          for base, size, op in zip(self.view_of, self.grad_size, nodes, strict=True)]
        self.keeps_grad = [op.cost.keeps_grad for op in nodes]
        # the gradient backward starts from: the loss's scalar, or (a pipeline stage before the
        # last) the received gradient of its output, in a receive buffer held for the step
        self.seed_bytes = 0 if graph.output_grad_received else self.grad_size[n - 1]
        self.out_grad = [op.cost.output.requires_grad and op.cost.has_backward for op in nodes]
        self.extras = [sum(round_bytes(b) for b in op.cost.saved_extra_bytes) for op in nodes]
        self.copies = [sum(round_bytes(b) for b in op.cost.autocast_copy_bytes) for op in nodes]
        self.copies_cached = [op.cost.autocast_copies_cached for op in nodes]
        self.category = [_LOGITS if op.spec.name in LOGITS_NODES else _ACTIVATIONS for op in nodes]
        self.grad_category = [_LOGITS if c == _LOGITS else _TEMPORARIES for c in self.category]
        self.block = [op.spec.block for op in nodes]
        self.kinds = [op.spec.kind for op in nodes]
        self.extras_out = [op.cost.extras_are_outputs for op in nodes]
        self.biases = [op.spec.bias for op in nodes]
        self.fwd_transient = [op.cost.fwd_transient_bytes for op in nodes]
        self.unsaved_transient = [op.cost.unsaved_fwd_transient_bytes for op in nodes]
        self.bwd_transient = [op.cost.bwd_transient_bytes for op in nodes]
        self.releases_out_grad = [op.cost.releases_output_grad for op in nodes]
        self.fwd_flops = [op.cost.fwd_flops for op in nodes]
        self.has_backward = [op.cost.has_backward for op in nodes]
        self.aliases = [tuple(op.cost.grad_aliases_input(s) for s in range(len(op.inputs))) for op in nodes]
        self.saved_slots = [tuple(op.cost.saves_input(s) for s in range(len(op.inputs))) for op in nodes]
        self.params: list[tuple[tuple[str, int], ...]] = [
            tuple((p.name, round_bytes(p.grad_elements * graph.precision.grad_dtype.n_bytes)) for p in op.spec.params
                  if not p.frozen)  # a frozen parameter (a fine-tuning plan's base) gets no gradient
            for op in nodes
        ]
        self.full_pending = [len(self.consumers[t]) + len(self.frame_users[t]) for t in range(n)]
        # a weight several ops use (a tied LM head and embedding): once its .grad exists, autograd
        # sums the later users' gradients in the accumulator's input buffer, which lives until the
        # first user's backward adds its own and the sum goes into .grad
        self.first_user: dict[str, int] = {}
        for i, params in enumerate(self.params):
            for name, _ in params:
                self.first_user.setdefault(name, i)
        # a pipeline's last stage caches its output (the logits) until the backward starts: the
        # loss, whose backward runs first, holds it (``LayerGraph.stage_output``)
        self.stage_output = position[graph.stage_output] if graph.stage_output is not None else None
        if self.stage_output is not None and self.stage_output != n - 1:
            self.savers[self.stage_output].append(n - 1)
