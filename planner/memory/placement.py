"""Exact checkpoint placement over the block chain (which blocks, not only how many).

The memory walk of a placement S (a status per block: checkpointed or not) decomposes, for a
chain of identical blocks, into terms that depend on one block's status at a time:

    live(event k of block i) = N[kind_i](k) + sum_{j < i} D[s_j]      (i >= 1)

where N[kind](k) is what the event would see with no earlier block, and D[s] is how much one
earlier block with status s adds (what it keeps for backward, less, in the first micro-batch's
backward, the gradient of one later block that has not appeared yet). The kind of a block is its
status, except that a plain block after a checkpointed one can see more: a model-wide tensor no
op saves is still held by the checkpoint units as an input. Block 0 has terms of its own: the
model-wide tensors every block shares (rotary tables, causal mask) die in its backward. The last
block may have terms of its own too (under FSDP2 no later unit's reduce-scatter input is held
during its backward); it is taken from the walk of its kind. Events after
the blocks see every block: their value moves linearly with the number of checkpointed blocks.
The decomposition is verified on every walk before it is used, so a graph that does not
decompose is refused rather than mispriced.

Three walks (nothing, block 0 only, everything checkpointed) give every term. Given them, a
dynamic program over (block, checkpointed so far) finds, for every count k, the placement with
the lowest peak: what a block sees depends only on how many earlier blocks are checkpointed, so
``best[i][c]`` (the lowest possible running peak over blocks < i with c of them checkpointed) is
exact. Checkpointing early blocks costs less peak than late ones: a late
block's recompute runs while every earlier block's activations are still alive.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from planner.errors import PlannerError
from planner.graph.layer_graph import LayerGraph
from planner.memory.step import Phase, StaticMemory, Timeline, TraceEvent, checkpoint_units, simulate_step
from planner.plan.checkpointing import TORCHTITAN_SAVE_LIST, CheckpointPolicy, SaveList
from planner.plan.schedule import Schedule

_FORWARD, _BACKWARD = "fwd", "bwd"
_BIG = 1 << 62  # no placement reaches it: the dynamic program's "unreachable"


class NotDecomposableError(PlannerError):
    """The walk of this graph does not split into per-block terms (blocks are not identical)."""


Terms = dict[tuple[int, str], list[int]]  # (micro-batch, group) -> value per event
_NONE, _CKPT, _AFTER = 0, 1, 2  # term kinds: plain block, checkpointed block, plain block after a checkpointed one


@dataclass(frozen=True)
class PlacementProfile:
    """Per-status terms of the memory walk, for one (graph, micro-batches, static memory).

    A plain block's events can depend on whether any earlier block is checkpointed: a model-wide
    tensor no op saves (the rotary tables under autocast) is still held by every checkpoint
    unit as an input, until the earliest unit's backward ends. Hence three kinds of terms.
    """

    n_blocks: int
    first: dict[int, Terms]  # status -> block 0's events
    terms: dict[int, Terms]  # kind -> events of a later block, without any earlier block's share
    last: dict[int, Terms]  # kind -> the last block's events, likewise (= terms unless it differs)
    step: dict[int, dict[tuple[int, str], int]]  # status -> (micro-batch, group) -> D
    outside: list[tuple[int, int, int]]  # events outside the blocks: value with 0, 1 and all L checkpointed

    def _kind(self, status: int, earlier_checkpointed: bool) -> int:
        return _CKPT if status else (_AFTER if earlier_checkpointed else _NONE)

    def _block_peak(self, index: int, kind: int, prefix: dict[tuple[int, str], int]) -> int:
        terms = self.first[kind] if index == 0 else self.last[kind] if index == self.n_blocks - 1 else self.terms[kind]
        return max(max(values) + prefix.get(key, 0) for key, values in terms.items())

    def _tail_peak(self, count: int) -> int:
        n = self.n_blocks
        if count == 0:
            return max((none for none, _, _ in self.outside), default=0)
        return max((one + (every - one) * (count - 1) // (n - 1) for _, one, every in self.outside), default=0)

    def peak(self, statuses: tuple[int, ...]) -> int:
        """Peak allocated bytes of the walk for ``statuses`` (1 = checkpointed), from the terms."""
        prefix: dict[tuple[int, str], int] = defaultdict(int)
        best = 0
        seen = False
        for index, s in enumerate(statuses):
            best = max(best, self._block_peak(index, self._kind(s, seen), prefix))
            seen = seen or bool(s)
            for key, d in self.step[s].items():
                prefix[key] += d
        return max(best, self._tail_peak(sum(statuses)))

    def min_peak_by_count(self) -> list[tuple[int, tuple[int, ...]]]:
        """For k = 0..L checkpointed blocks: (lowest peak, one placement achieving it).

        ``best[c]`` after block i: the lowest running peak over blocks <= i with c of them
        checkpointed; block i + 1 then sees prefix c D[1] + (i + 1 - c) D[0] on every key, so one
        numpy row per count (int64: exact) carries the program; ties checkpoint the earlier block."""
        import numpy as np

        n = self.n_blocks
        keys = list(dict.fromkeys([*self.step[0], *(k for t in (self.first, self.terms, self.last)
                                                    for terms in t.values() for k in terms)]))
        counts = np.arange(n + 1, dtype=np.int64)[:, None]
        step0, step1 = (np.array([self.step[s].get(k, 0) for k in keys], dtype=np.int64) for s in (0, 1))
        best = np.full(n + 1, _BIG, dtype=np.int64)
        best[0] = 0
        choices = []
        for i in range(n):
            prefix = counts * step1 + (i - counts) * step0
            plain = np.where(counts[:, 0] > 0, self._block_peaks(i, _AFTER, prefix, keys),
                             self._block_peaks(i, _NONE, prefix, keys))
            stay = np.maximum(best, plain)
            moved = np.full_like(best, _BIG)
            moved[1:] = np.maximum(best[:-1], self._block_peaks(i, _CKPT, prefix, keys)[:-1])
            pick = (moved <= stay) & (moved < _BIG)  # ties: checkpoint the earlier block
            best = np.where(pick, moved, stay)
            choices.append(pick)
        # every count's placement traced back at once: one gather per block over the L + 1 counts
        # (the same choices the per-count walk back reads; L^2 bits, not L^2 Python steps)
        picked = np.array(choices, dtype=bool)
        statuses = np.zeros((n + 1, n), dtype=np.int8)
        c = np.arange(n + 1)
        for i in range(n - 1, -1, -1):
            s = picked[i, c]
            statuses[:, i] = s
            c = c - s
        tails = self._tail_peaks()
        return [(int(max(int(best[k]), tails[k])), tuple(statuses[k].tolist())) for k in range(n + 1)]

    def _tail_peaks(self) -> list[int]:
        """``_tail_peak(k)`` for k = 0..L, each event's line evaluated for every count at once
        (floor division as Python's: numpy's ``//`` floors too)."""
        import numpy as np

        n = self.n_blocks
        if not self.outside:
            return [0] * (n + 1)
        none, one, every = (np.array(column, dtype=np.int64) for column in zip(*self.outside, strict=True))
        slope = every - one
        tails = [int(none.max())]
        for count in range(1, n + 1):
            tails.append(int((one + slope * (count - 1) // (n - 1)).max()))
        return tails

    def _block_peaks(self, index: int, kind: int, prefix: Any, keys: list[tuple[int, str]]) -> Any:
        """Block ``index``'s peak as ``kind`` for each row of ``prefix`` (count x key)."""
        import numpy as np

        place = self.first if index == 0 else self.last if index == self.n_blocks - 1 else self.terms
        terms = place.get(kind) if index else place.get(_NONE if kind == _AFTER else kind)
        if terms is None:
            return np.full(len(prefix), _BIG, dtype=np.int64)
        tops = np.array([max(terms[k]) if k in terms else -_BIG for k in keys], dtype=np.int64)
        return (prefix + tops).max(axis=1)


def _group(phase: Phase) -> str:
    return _FORWARD if phase is Phase.FORWARD else _BACKWARD


def _split(graph: LayerGraph, trace: tuple[TraceEvent, ...]) -> tuple[dict[tuple[int, str, int], list[int]], list[int]]:
    """Block events by (micro-batch, group, block) in order, and the other events in order."""
    blocks: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    outside: list[int] = []
    block_of, forward = graph.block_of, Phase.FORWARD
    for event in trace:
        block = block_of.get(event.op)
        if block is None:
            outside.append(event.live_bytes)
        else:
            group = _FORWARD if event.phase is forward else _BACKWARD  # _group, inlined: a walk has ~1e5 events
            blocks[(event.micro_batch, group, block)].append(event.live_bytes)
    return blocks, outside


MIN_BLOCKS = 4  # shorter chains are cheap to enumerate with the walk itself


def optimizer_step_bytes(timeline: Timeline) -> int:
    """Live bytes at the optimizer step of a walk recorded with its trace: every backward has
    freed its activations, so every placement (and segmentation, and policy) of the same graph and
    schedule reaches them; a lower bound of each one's peak."""
    return max(event.live_bytes for event in timeline.trace if event.phase is Phase.OPTIMIZER)


def placement_profile(
    graph: LayerGraph,
    static: StaticMemory,
    round_bytes: object,
    schedule: Schedule,
    all_checkpointed: Timeline | None = None,
    policy: CheckpointPolicy = CheckpointPolicy.FULL,
    save: SaveList = TORCHTITAN_SAVE_LIST,
    plain: Timeline | None = None,
) -> PlacementProfile:
    """Measure the terms with three walks (no block, block 0 only, every block checkpointed with
    ``policy``) and check, event by event, that every block of each walk is what the terms
    predict. ``plain``: the walk without checkpointing (with its trace), if the caller has it."""
    n = graph.model.n_layers
    if n < MIN_BLOCKS:
        raise NotDecomposableError(f"{n} blocks: enumerate the placements instead")
    runs: dict[str, tuple[dict[tuple[int, str, int], list[int]], list[int]]] = {}
    for name, placed in (("none", ()), ("first", (0,)), ("all", tuple(range(n)))):
        if name == "all" and all_checkpointed is not None and all_checkpointed.trace:
            timeline = all_checkpointed  # the caller already walked it
        elif name == "none" and plain is not None and plain.trace:
            timeline = plain  # no block checkpointed: the same walk for every policy
        else:
            timeline = simulate_step(graph, static, round_bytes,  # type: ignore[arg-type]
                                     checkpoint_units(n, placed, (), policy, save), schedule, record_trace=True)
        runs[name] = _split(graph, timeline.trace)
    first: dict[int, Terms] = {}
    terms: dict[int, Terms] = {}
    step: dict[int, dict[tuple[int, str], int]] = {}
    for status, run in ((0, "none"), (1, "all")):
        events = runs[run][0]
        first[status], terms[status], step[status] = {}, {}, {}
        for (micro, group, block), values in events.items():
            if block == 1:
                key = (micro, group)
                step[status][key] = events[(micro, group, 2)][0] - values[0]
                terms[status][key] = [v - step[status][key] for v in values]
                first[status][key] = events[(micro, group, 0)]
    after = runs["first"][0]
    terms[_AFTER] = {
        (micro, group): [v - step[1][(micro, group)] for v in values]
        for (micro, group, block), values in after.items() if block == 1
    }
    checks = (  # each walk's blocks past 0: their kind, and how many earlier blocks are checkpointed
        (runs["none"][0], _NONE, lambda i: 0),
        (runs["all"][0], _CKPT, lambda i: i),
        (after, _AFTER, lambda i: 1),
    )
    last: dict[int, Terms] = {kind: dict(t) for kind, t in terms.items()}
    for events, kind, checkpointed in checks:  # linearity, event by event
        for (micro, group, block), values in events.items():
            if block == 0:
                continue
            key = (micro, group)
            prefix = checkpointed(block) * step[1][key] + (block - checkpointed(block)) * step[0][key]
            if values == [v + prefix for v in terms[kind][key]]:
                continue
            if block == n - 1:  # the last block may differ (FSDP2: no later unit's buffer held)
                last[kind][key] = [v - prefix for v in values]
                continue
            raise NotDecomposableError(
                f"block {block} does not repeat block 1 ({micro=}, {group=}); placement needs identical blocks"
            )
    outside = [run[1] for run in (runs["none"], runs["first"], runs["all"])]
    if len({len(o) for o in outside}) != 1:
        raise NotDecomposableError("the walks outside the blocks differ in length")
    triples = list(zip(*outside, strict=True))
    if any((every - one) % (n - 1) for _, one, every in triples):
        raise NotDecomposableError("events after the blocks do not move by a whole per-block amount")
    return PlacementProfile(n_blocks=n, first=first, terms=terms, last=last, step=step, outside=triples)
