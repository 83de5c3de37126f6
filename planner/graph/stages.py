"""A model split into pipeline stages: each stage's graph, cut from the whole model's.

torchtitan splits a model for pipeline parallelism by building the whole model per stage and
deleting what the stage does not run (``torchtitan/distributed/pipeline_parallel.py``,
``pipeline_module_split``): the first stage keeps the token embedding, the last the final norm,
the LM head and the loss, and each stage a contiguous run of blocks. What the model's forward
computes outside the blocks for every block (the rotary tables, attention masks) runs on every
stage. A stage after the first starts from the activation it receives
(``planner.ops.pipeline``: ``STAGE_INPUT``), and a stage before the last ends at its last block's
output, whose gradient it receives in backward.

The cut keeps the whole graph's priced nodes (same costs, same names), so a stage's ops cost
exactly what they cost in the unsplit model.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.graph.layer_graph import GraphNode, LayerGraph, op_spec
from planner.ops.base import OpContext, OpKind
from planner.ops.catalog import cost_of

STAGE_INPUT = "stage_input"


@dataclass(frozen=True)
class StageSpan:
    """The blocks one pipeline stage runs: ``first_block`` to ``last_block``, both included."""

    first_block: int
    last_block: int

    @property
    def n_blocks(self) -> int:
        return self.last_block - self.first_block + 1


def even_spans(n_blocks: int, n_stages: int) -> tuple[StageSpan, ...]:
    """``n_blocks`` split into ``n_stages`` contiguous runs, the earlier stages one block longer
    when they do not divide (torchtitan's default split)."""
    if not 1 <= n_stages <= n_blocks:
        raise ValueError(f"{n_stages} stages of {n_blocks} blocks: each stage needs at least one block")
    base, extra = divmod(n_blocks, n_stages)
    spans, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        spans.append(StageSpan(start, start + size - 1))
        start += size
    return tuple(spans)


def spans_of(layers_per_stage: tuple[int, ...]) -> tuple[StageSpan, ...]:
    """Stages of the given numbers of blocks, in order (``--pp-layers 15,16,...``)."""
    spans, start = [], 0
    for size in layers_per_stage:
        spans.append(StageSpan(start, start + size - 1))
        start += size
    return tuple(spans)


def stage_graph(graph: LayerGraph, span: StageSpan) -> LayerGraph:
    """The graph of the stage running ``span`` of ``graph``'s blocks (see the module docstring)."""
    n_blocks = graph.model.n_layers
    if not 0 <= span.first_block <= span.last_block < n_blocks:
        raise ValueError(f"blocks {span.first_block}-{span.last_block} are not blocks of a {n_blocks}-block model")
    if span.first_block == 0 and span.last_block == n_blocks - 1:
        return graph
    block = graph.block_of
    index = {name: -1 if b is None else b for name, b in block.items()}  # -1: outside the blocks
    ran = {name for name in graph.order if span.first_block <= index[name] <= span.last_block}
    first_block_at = min(i for i, name in enumerate(graph.order) if block[name] is not None)
    before = [name for name in graph.order[:first_block_at] if block[name] is None]
    after = [name for name in graph.order[first_block_at:] if block[name] is None]
    boundary = _boundary(graph, ran, span) if span.first_block > 0 else None
    kept = (set(before) if span.first_block == 0 else _shared(graph, before, ran)) | ran
    if span.last_block == n_blocks - 1:
        kept |= set(after)
    order = [name for name in graph.order if name in kept]
    ops = {name: _renamed(graph.ops[name], boundary) for name in order}
    edges = [((STAGE_INPUT if p == boundary else p), c, slot, saved) for p, c, slot, saved in graph.edges
             if c in kept and (p in kept or p == boundary)]
    saved = {name: graph.saved[name] for name in order}
    if boundary is not None:
        node = _stage_input(graph, boundary)
        ops = {STAGE_INPUT: node, **ops}
        order.insert(0, STAGE_INPUT)
        saved[STAGE_INPUT] = node.cost.output.n_bytes if any(c[3] for c in edges if c[0] == STAGE_INPUT) else 0
    end = order[-1]
    held = {t: (u if u in kept else end) for t, u in graph.held_until.items() if t in kept}
    return LayerGraph(model=graph.model, batch=graph.batch, seq_len=graph.seq_len, precision=graph.precision,
                      ops=ops, order=tuple(order), held_until=held, saved=saved, edges=tuple(edges),
                      output_grad_received=span.last_block < n_blocks - 1,
                      stage_output=_logits(graph) if span.last_block == n_blocks - 1 else None)


def _boundary(graph: LayerGraph, ran: set[str], span: StageSpan) -> str:
    """The tensor the stage receives: what its first block reads from the block before it."""
    block = graph.block_of
    crossing = {p for p, c, _, _ in graph.edges if c in ran and block[p] == span.first_block - 1}
    if len(crossing) != 1:
        raise ValueError(f"block {span.first_block} reads {len(crossing)} tensors of block {span.first_block - 1}; "
                         "a pipeline stage boundary must carry one")
    return crossing.pop()


def _shared(graph: LayerGraph, before: list[str], ran: set[str]) -> set[str]:
    """The ops before the blocks that a later stage runs too: those the stage's blocks read
    directly (rotary tables, masks), with what they are computed from."""
    candidates = set(before)
    needed = {p for p, c, _, _ in graph.edges if c in ran and p in candidates}
    frontier = list(needed)
    while frontier:
        for p in graph.ops[frontier.pop()].inputs:
            if p in candidates and p not in needed:
                needed.add(p)
                frontier.append(p)
    return needed


def _logits(graph: LayerGraph) -> str:
    """The last stage's output: what its module returns before the schedule's loss (the LM head's,
    or Gemma 2's soft-capped logits)."""
    heads = [name for name in graph.order if graph.ops[name].spec.kind in (OpKind.LINEAR, OpKind.LOGIT_SOFTCAP)
             and graph.block_of[name] is None]
    return heads[-1]


def _renamed(node: GraphNode, boundary: str | None) -> GraphNode:
    if boundary is None or boundary not in node.inputs:
        return node
    inputs = tuple(STAGE_INPUT if t == boundary else t for t in node.inputs)
    return GraphNode(spec=node.spec, cost=node.cost, inputs=inputs)


def _stage_input(graph: LayerGraph, boundary: str) -> GraphNode:
    spec = op_spec(name=STAGE_INPUT, kind=OpKind.STAGE_INPUT, block=None)
    info = graph.ops[boundary].cost.output
    ctx = OpContext(batch=graph.batch, seq_len=graph.seq_len, precision=graph.precision, inputs=(info,))
    return GraphNode(spec=spec, cost=cost_of(spec, ctx), inputs=())
