"""Each rank's compute actions for torch 2.13's pipeline schedules, in the order torch runs them.

Transcribed from ``torch/distributed/pipelining/schedules.py`` (torch 2.13.0), pure Python (the
planner never imports torch; ``tests/planner/test_pipeline_schedules.py`` checks every order here
against torch's own over a grid of pp, virtual stages and micro-batches):

- ``ScheduleGPipe._step_microbatches`` and ``Schedule1F1B._step_microbatches`` (single-stage: the
  order their loops call ``forward_one_chunk`` / ``backward_one_chunk``);
- ``ScheduleLoopedBFS._calculate_single_rank_operations``;
- ``_get_1f1b_rank_ops`` with ``_get_warmup_ops``, as ``ScheduleInterleaved1F1B`` and
  ``ScheduleInterleavedZeroBubble`` call them (the latter's ``_add_bubbles_to_actions`` only adds
  ``None`` bubbles, never reorders);
- ``ScheduleZBVZeroBubble._calculate_single_rank_operations``;
- ``ScheduleDualPipeV._calculate_single_rank_operations``.

torch's ``pipeline_order`` holds ``None`` for a step where a rank waits; the runtime
(``_PipelineScheduleRuntime._step_microbatches``) skips them and waits on the receives instead, so
the order of the compute actions is all that matters and the ``None`` are dropped here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum


class ActionKind(StrEnum):
    """A compute action of torch's schedule IR (``_ComputationType``, same spellings)."""

    FORWARD = "F"
    FULL_BACKWARD = "B"  # input and weight gradients in one action
    BACKWARD_INPUT = "I"  # dI: the gradient sent to the previous stage
    BACKWARD_WEIGHT = "W"  # dW: the parameter gradient, deferrable
    OVERLAP_F_B = "OVERLAP_F_B"  # DualPipeV: one forward and one full backward of two stages, as one action


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` of ``micro_batch`` on global ``stage``. An ``OVERLAP_F_B`` holds
    its forward and full backward in ``parts`` and, like torch's ``_Action(-1, OVERLAP_F_B, None,
    sub_actions)``, has no stage nor micro-batch of its own (-1). torch's runtime runs the parts one
    after the other unless a custom function is registered for ``OVERLAP_F_B``."""

    stage: int
    kind: ActionKind
    micro_batch: int
    parts: tuple[Action, ...] = ()

    def __str__(self) -> str:  # torch's spelling: "3F1", "(0F5;7B2)OVERLAP_F_B"
        if self.parts:
            return f"({';'.join(map(str, self.parts))}){self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.micro_batch}"

    def computations(self) -> tuple[Action, ...]:
        """The actions that run, an overlap's parts in order."""
        return self.parts or (self,)


F, B, DI, W = ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def gpipe(rank: int, m: int) -> list[Action]:
    """``ScheduleGPipe._step_microbatches``: every forward, then every backward, in micro-batch order."""
    return [Action(rank, F, i) for i in range(m)] + [Action(rank, B, i) for i in range(m)]


def one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    """``Schedule1F1B._step_microbatches``: ``min(m, pp - rank)`` warm-up forwards, then backward and
    forward alternating ("1B1F") until the forwards run out, then the remaining backwards."""
    warmup = min(m, pp - rank)
    actions = [Action(rank, F, i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        actions.append(Action(rank, B, bwd))
        bwd += 1
        if fwd == m:
            break
        actions.append(Action(rank, F, fwd))
        fwd += 1
    actions += [Action(rank, B, i) for i in range(bwd, m)]
    return actions


def looped_bfs(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """``ScheduleLoopedBFS._calculate_single_rank_operations``: every micro-batch's forward through
    the rank's stages first to last, then the backwards, stages and micro-batches reversed."""
    stages = range(rank, pp * v, pp)
    actions = [Action(s, F, i) for s in stages for i in range(m)]
    return actions + [Action(s, B, i) for s in reversed(stages) for i in reversed(range(m))]


class _Counters:
    """The next micro-batch of each (stage, kind), as torch's schedules count them."""

    def __init__(self) -> None:
        self.next: Counter[tuple[int, ActionKind]] = Counter()

    def take(self, stage: int, kind: ActionKind) -> Action:
        mb = self.next[stage, kind]
        self.next[stage, kind] += 1
        return Action(stage, kind, mb)


def interleaved(rank: int, pp: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    """``ScheduleInterleaved1F1B`` (``zero_bubble`` False) and ``ScheduleInterleavedZeroBubble``
    (True, torch's ZB1P): ``_get_warmup_ops`` forwards, then one forward and one backward per step,
    then the cooldown backwards (``_get_1f1b_rank_ops``). Micro-batches go in rounds of
    ``m // max(1, m // pp)`` per local stage (depth first). Zero bubble splits each backward into I
    and W, holds back the W of a rank's first ``rank`` steady-state backwards, then runs one W after
    each backward, oldest first, and the held-back ones at the end."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v + warmup  # warm-up, steady (m v - warmup) and cool-down (warmup) steps

    def fwd_stage(step: int) -> int:
        return (step // per_round) % v * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - (step - warmup) // per_round % v) * pp + rank

    counters, actions, backward_steps = _Counters(), [], []
    for step in range(total):
        if step < m * v:
            actions.append(counters.take(fwd_stage(step), F))
        if step >= warmup:
            actions.append(counters.take(bwd_stage(step), DI if zero_bubble else B))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                actions.append(counters.take(bwd_stage(backward_steps.pop(0)), W))
    if zero_bubble:
        actions += [counters.take(bwd_stage(step), W) for step in backward_steps]
    return actions


def zbv(rank: int, pp: int, m: int) -> list[Action]:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (Qi et al. 2023, arXiv 2401.10241
    sec. 6, ZB-V): the rank holds stages ``rank`` (chunk 0) and ``2 pp - 1 - rank`` (chunk 1). Built
    for ``max(2 pp - 1, m)`` micro-batches; the actions of micro-batches past ``m`` are dropped, as
    torch turns them into bubbles."""
    n = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    counters, acts = _Counters(), []
    acts += [counters.take(c0, F) for _ in range(2 * (pp - rank) - 1)]
    for _ in range(rank):
        acts += [counters.take(c1, F), counters.take(c0, F)]
    for _ in range(pp - rank):
        acts += [counters.take(c1, F), counters.take(c1, DI), counters.take(c1, W)]
    while counters.next[c1, F] < counters.next[c0, F] or counters.next[c0, F] < n:
        if counters.next[c0, F] < n:
            acts.append(counters.take(c0, F))
        acts += [counters.take(c0, DI), counters.take(c0, W)]
        acts += [counters.take(c1, F), counters.take(c1, DI), counters.take(c1, W)]
    for _ in range(rank):
        acts += [counters.take(c0, DI), counters.take(c1, DI)]
    for _ in range(pp - rank):
        acts += [counters.take(c0, DI), counters.take(c0, W)]
    while counters.next[c1, W] < counters.next[c1, DI]:
        acts.append(counters.take(c1, W))
    while counters.next[c0, W] < counters.next[c0, DI]:
        acts.append(counters.take(c0, W))
    return [a for a in acts if a.micro_batch < m]


class _DualPipeV:
    """The counters and the queue of deferred weight gradients of
    ``ScheduleDualPipeV._calculate_single_rank_operations``: a full backward advances a stage's I
    and W counters together; an I queues its W, which ``weight`` runs later, oldest first."""

    def __init__(self) -> None:
        self.counters = _Counters()
        self.weights: list[Action] = []
        self.actions: list[Action] = []

    def add(self, stage: int, kind: ActionKind) -> None:
        self.actions.append(self._make(stage, kind))

    def _make(self, stage: int, kind: ActionKind) -> Action:
        if kind is B:
            self.counters.next[stage, W] += 1
            return Action(stage, B, self.counters.take(stage, DI).micro_batch)
        action = self.counters.take(stage, kind)
        if kind is DI:
            self.weights.append(Action(stage, W, action.micro_batch))
        return action

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        parts = (self._make(forward_stage, F), self._make(backward_stage, B))
        self.actions.append(Action(-1, ActionKind.OVERLAP_F_B, -1, parts))

    def weight(self) -> None:
        if self.weights:
            self.actions.append(self.weights.pop(0))


def dualpipev(rank: int, pp: int, m: int) -> list[Action]:
    """``ScheduleDualPipeV._calculate_single_rank_operations`` (DeepSeek-V3, arXiv 2412.19437, as
    the "cut-in-half" DualPipeV of github.com/deepseek-ai/DualPipe): eight phases, the main one
    pairing a forward of one chunk with a full backward of the other as ``OVERLAP_F_B``."""
    c0, c1 = rank, 2 * pp - 1 - rank
    s = _DualPipeV()
    for _ in range(2 * (pp - rank - 1)):  # 1: F0
        s.add(c0, F)
    for _ in range(rank + 1):  # 2: F0 F1
        s.add(c0, F)
        s.add(c1, F)
    for _ in range(pp - rank - 1):  # 3: I1 W F1 (zero bubble)
        s.add(c1, DI)
        s.weight()
        s.add(c1, F)
    for i in range(m - 2 * pp + rank + 1):  # 4: F0B1 F1B0, overlapped
        if i == 0 and rank == pp - 1:  # torch does not overlap these two, to shrink the bubble
            s.add(c0, F)
            s.add(c1, B)
        else:
            s.overlap(c0, c1)
        s.overlap(c1, c0)
    for _ in range(pp - rank - 1):  # 5: B1 F1B0
        s.add(c1, B)
        s.overlap(c1, c0)
    zero_bubble = False
    for i in range(rank + 1):  # 6: B1 B0, zero bubble from the middle on
        zero_bubble |= i == (rank + 1) // 2 and rank % 2 == 1
        s.add(c1, DI if zero_bubble else B)
        zero_bubble |= i == (rank + 1) // 2 and rank % 2 == 0
        s.add(c0, DI if zero_bubble else B)
    for _ in range(pp - rank - 1):  # 7: W B0
        s.weight()
        s.add(c0, DI if zero_bubble else B)
    for _ in range(rank + 1):  # 8: W
        s.weight()
    return s.actions
