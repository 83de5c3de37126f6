"""Exact checkpoint placement over a chain of blocks that differ (several kinds of block).

``planner.memory.placement`` needs identical blocks. DeepSeek-V3's dense first blocks, gpt-oss's
alternating sliding and full attention and MoE every n-th block break that, so here every block
gets terms of its own and only what one checkpointed block adds to later blocks is shared. With
S a placement (s_j = 1: block j checkpointed), per (micro-batch, group) key:

    live(event k of block i) = X_i[s_i, c_i](k) + sum_{j < i, s_j = 1} Delta_j

X_i[0, none]: block i plain, no earlier block checkpointed; X_i[0, after]: plain with some
earlier block checkpointed (the checkpoint units hold model-wide tensors no op saves, as in
``planner.memory.placement``); X_i[1]: block i checkpointed. Delta_j is what checkpointing block j
changes in every later block (what its forward no longer keeps, a constant per key). Events
outside the blocks move by a jump J when any block is checkpointed and by delta[kind] per
checkpointed block of each kind (the blocks' structure, ``block_kinds``):

    outside(event t) = none_t + [S nonempty] J_t + sum_kind n_kind(S) delta[kind]_t

Five walks give every term (W0: none; W1: block 0; We: even blocks; Wo: odd blocks; Wa: all):

- X_i[0, none] = W0(i); X_i[1] = Wa(i) - sum_{j<i} Delta_j;
- Wa(i) - We(i) (i even) = sum of Delta over the odd blocks before i, Wa(i) - Wo(i) (i odd)
  the sum over the even ones: each a constant shift of the block's events (checked), whose
  differences give Delta_j for every j < L - 1 (the last block's reaches no later block);
- X_i[0, after] = W1(i) - Delta_0 (i >= 1);
- J and delta[kind] solve the outside events of W1, We, Wo and Wa (an overdetermined system).

Every block of every walk is then checked against the terms: each plain block of We and Wo
predicted from W1 and the Deltas measured on the checkpointed blocks (independent
measurements), block 0 in each walk, and every outside event (the system's residual is zero).
A graph that does not decompose is refused, never mispriced.

The dynamic program: what block i sees depends on the earlier placement only through
sum_{j<i, s_j=1} Delta_j and whether any is checkpointed, i.e. through how many checkpointed
blocks of each Delta class came before (blocks with equal Delta and delta are one class). So
``best[i][n]`` (n: checkpointed count per class) is the lowest possible running peak over the
blocks before i; O(L * prod_c (L_c + 1)) states (refused beyond ``MAX_STATES``), vectorized with
numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from planner.graph.layer_graph import LayerGraph
from planner.memory.placement import MIN_BLOCKS, NotDecomposableError, PlacementProfile, _split, placement_profile
from planner.memory.step import StaticMemory, Timeline, checkpoint_units, simulate_step
from planner.plan.checkpointing import TORCHTITAN_SAVE_LIST, CheckpointPolicy, SaveList
from planner.plan.schedule import Schedule

Key = tuple[int, str]  # (micro-batch, group)
Events = dict[tuple[int, str, int], list[int]]  # (micro-batch, group, block) -> live bytes per event
PLAIN, CKPT, AFTER = 0, 1, 2  # a block's terms: plain, checkpointed, plain after a checkpointed one
MAX_KINDS = 2  # the outside events give four equations: J and at most two deltas leave one to check
MAX_STATES = 250_000  # count vectors the dynamic program may track (prod over classes of blocks + 1)
_BIG = 1 << 62


def block_kinds(graph: LayerGraph) -> list[int]:
    """Each block's structural kind: blocks whose ops have the same kinds and costs, in order,
    share one (the graph builder reuses one cost object for equal ops)."""
    names: dict[tuple[object, ...], int] = {}
    kinds = []
    nodes = graph.nodes
    for block in range(graph.model.n_layers):
        signature = tuple((nodes[p].spec.kind, id(nodes[p].cost)) for p in graph.block_nodes[block])
        kinds.append(names.setdefault(signature, len(names)))
    return kinds


@dataclass(frozen=True)
class KindsProfile:
    """Per-block terms of the memory walk and the shared Deltas (see the module docstring).

    ``tops[i][term][key]``: the largest event of block i's ``term`` (PLAIN, CKPT, AFTER) for that
    key, without any earlier block's Delta; ``delta_class[c][key]``: Delta of class c;
    ``class_of[i]``: block i's class; ``outside``: per event (none, J, delta per class)."""

    n_blocks: int
    keys: tuple[Key, ...]
    tops: tuple[dict[int, dict[Key, int]], ...]
    class_of: tuple[int, ...]
    delta_class: tuple[dict[Key, int], ...]
    outside: tuple[tuple[int, int, tuple[int, ...]], ...]

    def _tail_peak(self, counts: tuple[int, ...]) -> int:
        if not any(counts):
            return max((none for none, _, _ in self.outside), default=0)
        return max((none + jump + sum(n * d for n, d in zip(counts, deltas, strict=True))
                    for none, jump, deltas in self.outside), default=0)

    def peak(self, statuses: tuple[int, ...]) -> int:
        """Peak allocated bytes of the walk for ``statuses`` (1 = checkpointed), from the terms."""
        prefix = dict.fromkeys(self.keys, 0)
        counts = [0] * len(self.delta_class)
        best = 0
        for i, s in enumerate(statuses):
            term = CKPT if s else (AFTER if any(counts) else PLAIN)
            best = max(best, max(top + prefix[key] for key, top in self.tops[i][term].items()))
            if s:
                c = self.class_of[i]
                counts[c] += 1
                for key in self.keys:
                    prefix[key] += self.delta_class[c][key]
        return max(best, self._tail_peak(tuple(counts)))

    def min_peak_by_count(self) -> list[tuple[int, tuple[int, ...]]]:
        """For k = 0..L checkpointed blocks: (lowest peak, one placement achieving it)."""
        import numpy as np

        sizes = tuple(self.class_of.count(c) + 1 for c in range(len(self.delta_class)))
        grid = np.indices(sizes).reshape(len(sizes), -1).T  # every count vector n, flattened (C order)
        prefix = grid @ np.array([[d[key] for key in self.keys] for d in self.delta_class], dtype=np.int64)
        seen = grid.sum(axis=1) > 0
        strides = [int(np.prod(sizes[c + 1:], dtype=np.int64)) for c in range(len(sizes))]
        best = np.full(len(grid), _BIG, dtype=np.int64)  # lowest running peak reaching each n
        best[0] = 0
        picks = []
        for i in range(self.n_blocks):
            top = {t: np.array([terms.get(key, -_BIG) for key in self.keys], dtype=np.int64)
                   for t, terms in self.tops[i].items()}
            plain = (prefix + top[PLAIN]).max(axis=1)
            if AFTER in top:
                plain = np.where(seen, (prefix + top[AFTER]).max(axis=1), plain)
            stay = np.maximum(best, plain)
            c = self.class_of[i]
            moved = np.full_like(best, _BIG)
            target = np.nonzero(grid[:, c] > 0)[0]  # n with n_c > 0 comes from n - e_c
            source = target - strides[c]
            moved[target] = np.maximum(best[source], (prefix[source] + top[CKPT]).max(axis=1))
            pick = (moved <= stay) & (moved < _BIG)  # ties: checkpoint the earlier block
            best = np.where(pick, moved, stay)
            picks.append(pick)
        final = np.maximum(best, self._tail_peaks(grid))
        totals = grid.sum(axis=1)
        out = []
        for k in range(self.n_blocks + 1):
            candidates = np.nonzero((totals == k) & (best < _BIG))[0]
            state = int(candidates[np.argmin(final[candidates])])
            out.append((int(final[state]), self._rebuild(picks, state, strides)))
        return out

    def _tail_peaks(self, grid: Any) -> Any:
        """The outside events' peak for every count vector (rows of ``grid``)."""
        import numpy as np

        if not self.outside:
            return np.zeros(len(grid), dtype=np.int64)
        none = np.array([o[0] for o in self.outside], dtype=np.int64)
        jump = np.array([o[1] for o in self.outside], dtype=np.int64)
        deltas = np.array([o[2] for o in self.outside], dtype=np.int64)  # (events, classes)
        peaks = (none + jump + grid @ deltas.T).max(axis=1)
        peaks[0] = none.max()
        return peaks

    def _rebuild(self, picks: list[Any], state: int, strides: list[int]) -> tuple[int, ...]:
        statuses = []
        for i in range(self.n_blocks - 1, -1, -1):
            s = int(picks[i][state])
            statuses.append(s)
            state -= s * strides[self.class_of[i]]
        return tuple(reversed(statuses))


def _shift(a: list[int], b: list[int], what: str) -> int:
    """The constant d with a = b + d event by event, else NotDecomposableError."""
    if len(a) != len(b) or any(x - y != a[0] - b[0] for x, y in zip(a, b, strict=True)):
        raise NotDecomposableError(f"{what}: not a constant shift of the other walk's events")
    return a[0] - b[0]


def _walks(graph: LayerGraph, static: StaticMemory, round_bytes: object, schedule: Schedule,
           policy: CheckpointPolicy, save: SaveList, given: dict[str, Timeline | None]) -> dict[str, tuple[Events, list[int]]]:
    """The five walks, split into block events and outside events (``given``: walks the caller has)."""
    n = graph.model.n_layers
    placements = {"none": (), "first": (0,), "even": tuple(range(0, n, 2)), "odd": tuple(range(1, n, 2)),
                  "all": tuple(range(n))}
    runs = {}
    for name, placed in placements.items():
        timeline = given.get(name)
        if timeline is None or not timeline.trace:
            timeline = simulate_step(graph, static, round_bytes,  # type: ignore[arg-type]
                                     checkpoint_units(n, placed, (), policy, save), schedule, record_trace=True)
        runs[name] = _split(graph, timeline.trace)
    keys = set(runs["none"][0])
    if any(set(run[0]) != keys for run in runs.values()):
        raise NotDecomposableError("the walks' block events differ in shape")
    return runs


def _deltas(runs: dict[str, tuple[Events, list[int]]], keys: tuple[Key, ...], n: int) -> list[dict[Key, int]]:
    """Delta_j for j < n - 1, from the checkpointed blocks: Wa(i) - We(i) for even i, Wa(i) - Wo(i)
    for odd i, is the sum of Delta over the earlier blocks of the other parity."""
    every, sums = runs["all"][0], []
    for i in range(n):
        other = runs["even" if i % 2 == 0 else "odd"][0]
        sums.append({key: _shift(every[(*key, i)], other[(*key, i)], f"block {i} {key}") for key in keys})
    if any(sums[0].values()):
        raise NotDecomposableError("block 0 differs between two walks that checkpoint it alone")
    zero = dict.fromkeys(keys, 0)
    return [{key: sums[j + 1][key] - (sums[j - 1] if j else zero)[key] for key in keys} for j in range(n - 1)]


def _check_plain_blocks(runs: dict[str, tuple[Events, list[int]]], keys: tuple[Key, ...], n: int,
                        deltas: list[dict[Key, int]]) -> None:
    """Every plain block of We and Wo must be W1's (block 0 checkpointed: X_i[0, after] + Delta_0)
    less Delta_0, plus the Deltas of the walk's checkpointed blocks before it; block 0 must be the
    same in the walks that give it the same status."""
    first = runs["first"][0]
    for key in keys:
        if first[(*key, 0)] != runs["all"][0][(*key, 0)] or runs["odd"][0][(*key, 0)] != runs["none"][0][(*key, 0)]:
            raise NotDecomposableError(f"block 0 {key} differs between walks that give it the same status")
        for name, checkpointed in (("even", 0), ("odd", 1)):  # parity of the walk's checkpointed blocks
            events = runs[name][0]
            shift = -deltas[0][key] * checkpointed  # sum of Delta_j over its checkpointed j < i, less Delta_0
            for i in range(1, n):
                if i % 2 == checkpointed:
                    shift += deltas[i][key] if i < n - 1 else 0
                elif events[(*key, i)] != [v + shift for v in first[(*key, i)]]:
                    raise NotDecomposableError(f"block {i} {key}: a plain block does not see the earlier Deltas")


def _solve(rows: list[list[int]], columns: list[list[int]]) -> list[list[int]]:
    """Exact integer solution u of rows @ u = column for each column (Gauss-Jordan over the
    rationals); NotDecomposableError unless the rows have full column rank, leave at least one
    equation over to check, and every column is solved exactly by whole numbers."""
    width = len(rows[0])
    if len(rows) <= width:
        raise NotDecomposableError("too many kinds of block to check the events outside the blocks")
    table = [[Fraction(x) for x in row] + [Fraction(col[r]) for col in columns] for r, row in enumerate(rows)]
    for c in range(width):
        pivot = next((r for r in range(c, len(table)) if table[r][c] != 0), None)
        if pivot is None:
            raise NotDecomposableError("the walks cannot tell the kinds of block apart outside the blocks")
        table[c], table[pivot] = table[pivot], table[c]
        table[c] = [x / table[c][c] for x in table[c]]
        for r in range(len(table)):
            if r != c and table[r][c] != 0:
                factor = table[r][c]
                table[r] = [x - factor * y for x, y in zip(table[r], table[c], strict=True)]
    if any(x != 0 for row in table[width:] for x in row) or any(x.denominator != 1 for row in table[:width] for x in row):
        raise NotDecomposableError("the events outside the blocks are not linear in the checkpointed blocks")
    return [[int(table[c][width + t]) for c in range(width)] for t in range(len(columns))]


def _outside(runs: dict[str, tuple[Events, list[int]]], kinds: list[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """(none, J, delta per kind) for each event outside the blocks, from W1, We, Wo and Wa."""
    n, n_kinds = len(kinds), max(kinds) + 1
    placements = {"first": (0,), "even": range(0, n, 2), "odd": range(1, n, 2), "all": range(n)}
    rows = [[1] + [sum(1 for b in placed if kinds[b] == k) for k in range(n_kinds)] for placed in placements.values()]
    lengths = {len(run[1]) for run in runs.values()}
    if len(lengths) != 1:
        raise NotDecomposableError("the walks outside the blocks differ in length")
    none = runs["none"][1]
    columns = [[runs[name][1][t] - none[t] for name in placements] for t in range(len(none))]
    return [(none[t], u[0], tuple(u[1:])) for t, u in enumerate(_solve(rows, columns))]


def _classes(deltas: list[dict[Key, int]], keys: tuple[Key, ...], kinds: list[int],
             outside: list[tuple[int, int, tuple[int, ...]]]) -> tuple[list[int], list[tuple[tuple[int, ...], ...]]]:
    """Blocks with equal Delta and equal outside deltas share a class (the DP counts each class);
    the last block, whose Delta reaches no block, joins a class with its kind's outside deltas."""
    per_kind = [tuple(o[2][k] for o in outside) for k in range(max(kinds) + 1)]
    index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    class_of = [index.setdefault((tuple(d[key] for key in keys), per_kind[kinds[j]]), len(index))
                for j, d in enumerate(deltas)]
    last = next((c for (_, tail), c in index.items() if tail == per_kind[kinds[-1]]), None)
    if last is None:
        last = index.setdefault(((0,) * len(keys), per_kind[kinds[-1]]), len(index))
    return [*class_of, last], list(index)


def _tops(runs: dict[str, tuple[Events, list[int]]], keys: tuple[Key, ...],
          deltas: list[dict[Key, int]]) -> tuple[dict[int, dict[Key, int]], ...]:
    """Each block's largest event per key of each term, without the earlier blocks' Deltas:
    X_i[0, none] from W0, X_i[1] from Wa less every earlier Delta, X_i[0, after] from W1 less
    Delta_0 (block 0 is never after a checkpointed block)."""
    n = len(deltas) + 1
    tops = []
    prefix = dict.fromkeys(keys, 0)
    for i in range(n):
        terms = {PLAIN: {k: max(runs["none"][0][(*k, i)]) for k in keys},
                 CKPT: {k: max(runs["all"][0][(*k, i)]) - prefix[k] for k in keys}}
        if i:
            terms[AFTER] = {k: max(runs["first"][0][(*k, i)]) - deltas[0][k] for k in keys}
        tops.append(terms)
        if i < n - 1:
            prefix = {k: prefix[k] + deltas[i][k] for k in keys}
    return tuple(tops)


def kinds_profile(
    graph: LayerGraph,
    static: StaticMemory,
    round_bytes: object,
    schedule: Schedule,
    all_checkpointed: Timeline | None = None,
    policy: CheckpointPolicy = CheckpointPolicy.FULL,
    save: SaveList = TORCHTITAN_SAVE_LIST,
    plain: Timeline | None = None,
) -> KindsProfile:
    """Measure the per-block terms with five walks (``plain``, ``all_checkpointed``: the walks
    without and with every block checkpointed, if the caller has them with their traces) and
    check every walk against them (module docstring); NotDecomposableError if they do not hold."""
    n = graph.model.n_layers
    kinds = block_kinds(graph)
    if n < MIN_BLOCKS or max(kinds) + 1 > MAX_KINDS:
        raise NotDecomposableError(f"{n} blocks of {max(kinds) + 1} kinds: enumerate or walk the placements")
    runs = _walks(graph, static, round_bytes, schedule, policy, save, {"none": plain, "all": all_checkpointed})
    keys = tuple(sorted({(m, g) for m, g, _ in runs["none"][0]}))
    deltas = _deltas(runs, keys, n)
    _check_plain_blocks(runs, keys, n, deltas)
    outside = _outside(runs, kinds)
    class_of, classes = _classes(deltas, keys, kinds, outside)
    if math.prod(class_of.count(c) + 1 for c in range(len(classes))) > MAX_STATES:
        raise NotDecomposableError(f"{len(classes)} classes of checkpointed block: too many states to count")
    delta_class = tuple(dict(zip(keys, d, strict=True)) for d, _ in classes)
    out = tuple((none, jump, tuple(tail[t] for _, tail in classes)) for t, (none, jump, _) in enumerate(outside))
    return KindsProfile(n_blocks=n, keys=keys, tops=_tops(runs, keys, deltas), class_of=tuple(class_of),
                        delta_class=delta_class, outside=out)


def exact_profile(
    graph: LayerGraph,
    static: StaticMemory,
    round_bytes: object,
    schedule: Schedule,
    all_checkpointed: Timeline | None = None,
    policy: CheckpointPolicy = CheckpointPolicy.FULL,
    save: SaveList = TORCHTITAN_SAVE_LIST,
    plain: Timeline | None = None,
) -> PlacementProfile | KindsProfile:
    """The exact placement profile of this graph: ``planner.memory.placement``'s (three walks) when its
    blocks are alike, else this module's (five walks); NotDecomposableError if neither holds."""
    if len(set(block_kinds(graph))) == 1:
        try:
            return placement_profile(graph, static, round_bytes, schedule, all_checkpointed, policy, save, plain)
        except NotDecomposableError:
            pass
    return kinds_profile(graph, static, round_bytes, schedule, all_checkpointed, policy, save, plain)
