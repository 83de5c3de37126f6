"""torch 2.13's pipeline schedules as pure Python (planner/plan/pipeline_schedules.py,
planner/plan/pipeline_orders.py), checked against torch itself:

- the multi-stage schedules (interleaved 1F1B, looped BFS, interleaved zero bubble, ZB-V,
  DualPipeV): torch's own schedule objects, built on stand-in stages that carry only the
  attributes their constructors read (torch's tests use a ``MockPipelineStage`` the same way);
  their ``pipeline_order`` with the ``None`` bubbles dropped must equal ours, action for action;
- GPipe and 1F1B: their ``_step_microbatches`` run on a stand-in stage that records each
  ``forward_one_chunk`` / ``backward_one_chunk`` call (no process group: the stand-in has no
  send or receive ops); the recorded order must equal ours (their ``pipeline_order`` IR is
  compared separately: 1F1B's differs on the last rank);
- every request of the grid that torch's constructor refuses, ``check_pipeline`` refuses, and
  every one it accepts, ``check_pipeline`` accepts.
"""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as ts
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping, generate_stage_to_rank_mapping

from planner.errors import ConfigError
from planner.plan.pipeline_schedules import (
    Action,
    ActionKind,
    PipelineSchedule,
    check_pipeline,
    rank_actions,
    rank_stages,
    stage_rank,
)

S = PipelineSchedule
TORCH = {S.GPIPE: ts.ScheduleGPipe, S.ONE_F_ONE_B: ts.Schedule1F1B, S.INTERLEAVED_1F1B: ts.ScheduleInterleaved1F1B,
         S.LOOPED_BFS: ts.ScheduleLoopedBFS, S.INTERLEAVED_ZERO_BUBBLE: ts.ScheduleInterleavedZeroBubble,
         S.ZBV_ZERO_BUBBLE: ts.ScheduleZBVZeroBubble, S.DUALPIPEV: ts.ScheduleDualPipeV}
V_STYLE = {S.ZBV_ZERO_BUBBLE, S.DUALPIPEV}
CASES = [(schedule, pp, v) for schedule in S for pp in (2, 3, 4) for v in (1, 2, 3)]
GRID = [(schedule, pp, v, m) for schedule, pp, v in CASES for m in range(1, 13)]


class StandInStage:
    """What the schedules read of a ``_PipelineStageBase``, and a record of the chunks run."""

    def __init__(self, index: int, n_stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, rank
        self.submod = None  # not a module: _check_torch_compile_compatibility skips it
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.calls: list[tuple[int, str, int]] = []

    def forward_one_chunk(self, mb: int, *args: object, **kwargs: object) -> None:
        self.calls.append((self.stage_index, "F", mb))

    def backward_one_chunk(self, mb: int, **kwargs: object) -> None:
        self.calls.append((self.stage_index, "B", mb))

    def get_fwd_recv_ops(self, mb: int) -> list:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, scale: int) -> None:
        pass


def _torch_schedule(schedule: PipelineSchedule, pp: int, v: int, m: int, rank: int = 0):  # noqa: ANN202
    style = "v" if schedule in V_STYLE else "loop"
    stages = generate_rank_to_stage_mapping(pp, pp * v, style)[rank]
    made = [StandInStage(s, pp * v, pp, rank) for s in stages]
    cls = TORCH[schedule]
    return cls(made[0], m) if v == 1 and schedule in (S.GPIPE, S.ONE_F_ONE_B) else cls(made, m)


def _flat(action) -> tuple:  # noqa: ANN001
    """An action of torch or ours as nested tuples (an overlap's micro-batch: None in torch, -1 here)."""
    if isinstance(action, Action):
        return tuple(map(_flat, action.parts)) if action.parts else (action.stage, action.kind.value, action.micro_batch)
    if action.sub_actions is not None:
        return tuple(map(_flat, action.sub_actions))
    return (action.stage_index, action.computation_type.value, action.microbatch_index)


def _torch_refuses(schedule: PipelineSchedule, pp: int, v: int, m: int) -> bool:
    if schedule in (S.GPIPE, S.ONE_F_ONE_B) and v != 1:
        return True  # a PipelineScheduleSingle takes one stage object, not a list
    try:
        _torch_schedule(schedule, pp, v, m)
    except ValueError:
        return True
    return False


def _torch_orders(schedule: PipelineSchedule, pp: int, v: int, m: int) -> list[list[tuple]]:
    """Each rank's compute actions as torch runs them: the recorded chunks of ``_step_microbatches``
    for a single-stage schedule, ``pipeline_order`` without bubbles and REDUCE_GRAD otherwise."""
    if schedule in (S.GPIPE, S.ONE_F_ONE_B):
        runs = []
        for rank in range(pp):
            sched = _torch_schedule(schedule, pp, 1, m, rank)
            sched._initialize_stage = lambda *args, **kwargs: None  # no tensors to infer shapes from
            sched._step_microbatches()
            runs.append(sched._stage.calls)
        return runs
    order = _torch_schedule(schedule, pp, v, m).pipeline_order
    return [[_flat(a) for a in order[rank] if a is not None and a.computation_type != ts.REDUCE_GRAD]
            for rank in range(pp)]


@pytest.mark.parametrize(("schedule", "pp", "v"), CASES, ids=lambda x: str(x))
def test_orders_and_refusals_match_torch(schedule: PipelineSchedule, pp: int, v: int) -> None:
    """m from 1 to 12: torch refuses, and we do, or both give the same orders."""
    for m in range(1, 13):
        if _torch_refuses(schedule, pp, v, m):
            with pytest.raises(ConfigError):
                check_pipeline(schedule, pp, m, v)
            continue
        ours = rank_actions(schedule, pp, m, v)
        for rank, expected in enumerate(_torch_orders(schedule, pp, v, m)):
            assert [_flat(a) for a in ours[rank]] == expected, f"m {m}, rank {rank}"


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_single_stage_pipeline_order_ir(pp: int) -> None:
    """torch's ``_get_pipeline_order`` of the single-stage schedules (an IR for tools, not what
    ``_step_microbatches`` runs) lists GPipe's order exactly; for 1F1B it agrees on every rank but
    the last, where it starts at forward 1 and never runs forward 0 (``forward_mb += 1`` before the
    first steady-state forward when there is no warm-up): the loop is what runs, so we follow it."""
    m = 2 * pp
    for schedule in (S.GPIPE, S.ONE_F_ONE_B):
        order = _torch_schedule(schedule, pp, 1, m).pipeline_order
        ir = [[_flat(a) for a in order[r] if a is not None and a.computation_type != ts.REDUCE_GRAD] for r in range(pp)]
        ours = [[_flat(a) for a in actions] for actions in rank_actions(schedule, pp, m)]
        last = pp - 1 if schedule is S.ONE_F_ONE_B else pp
        assert ir[:last] == ours[:last]
        if schedule is S.ONE_F_ONE_B:
            assert ir[-1][0] == (pp - 1, "F", 1) and (pp - 1, "F", 0) not in ir[-1]


@pytest.mark.parametrize("schedule", list(S))
@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_stage_layout_matches_torch(schedule: PipelineSchedule, pp: int) -> None:
    v = 2 if schedule in V_STYLE else 3 if schedule not in (S.GPIPE, S.ONE_F_ONE_B) else 1
    style = "v" if schedule in V_STYLE else "loop"
    mapping = generate_stage_to_rank_mapping(pp, pp * v, style)
    assert [stage_rank(schedule, pp, s) for s in range(pp * v)] == [mapping[s] for s in range(pp * v)]
    held = generate_rank_to_stage_mapping(pp, pp * v, style)
    assert rank_stages(schedule, pp, v) == tuple(tuple(held[r]) for r in range(pp))
    if schedule in V_STYLE:
        assert all(rank_stages(schedule, pp, v)[r] == (r, 2 * pp - 1 - r) for r in range(pp))


def test_each_stage_runs_every_micro_batch_forward_then_backward_once() -> None:
    """What torch's ``_validate_schedule`` asserts, on our orders: per stage, m forwards, and the
    backwards (full, or input then weight) once each after their forward."""
    for schedule, pp, v, m in GRID:
        try:
            ranks = rank_actions(schedule, pp, m, v)
        except ConfigError:
            continue
        done: set[tuple[int, ActionKind, int]] = set()
        for actions in ranks:
            for action in (c for a in actions for c in a.computations()):
                before = {ActionKind.FORWARD: None, ActionKind.BACKWARD_WEIGHT: ActionKind.BACKWARD_INPUT}.get(
                    action.kind, ActionKind.FORWARD)
                assert before is None or (action.stage, before, action.micro_batch) in done
                assert (action.stage, action.kind, action.micro_batch) not in done
                done.add((action.stage, action.kind, action.micro_batch))
        for stage in range(pp * v):
            for mb in range(m):
                assert (stage, ActionKind.FORWARD, mb) in done
                assert ((stage, ActionKind.FULL_BACKWARD, mb) in done) != (
                    (stage, ActionKind.BACKWARD_WEIGHT, mb) in done)


def test_action_spelling_is_torchs() -> None:
    assert str(Action(3, ActionKind.FORWARD, 1)) == "3F1" == str(ts._Action(3, ts.F, 1))
    parts = (Action(0, ActionKind.FORWARD, 5), Action(7, ActionKind.FULL_BACKWARD, 2))
    overlap = ts._Action(-1, ts.OVERLAP_F_B, None, (ts._Action(0, ts.F, 5), ts._Action(7, ts.B, 2)))
    assert str(Action(-1, ActionKind.OVERLAP_F_B, -1, parts)) == str(overlap)


REFUSALS = [
    (S.ONE_F_ONE_B, 1, 4, 1, None, "--pp 1: 1 rank"),
    (S.GPIPE, 4, 8, 2, None, "--pp-virtual 2: --pp-schedule gpipe runs one stage per rank"),
    (S.ZBV_ZERO_BUBBLE, 4, 8, 3, None, "--pp-virtual 3: --pp-schedule zbv-zero-bubble runs exactly 2 stages"),
    (S.DUALPIPEV, 4, 8, 1, None, "--pp-virtual 1: --pp-schedule dualpipev runs exactly 2 stages"),
    (S.ONE_F_ONE_B, 4, 3, 1, None, "micro-batches per step .*: --pp-schedule 1f1b needs at least --pp = 4"),
    (S.DUALPIPEV, 4, 7, 2, None, "micro-batches per step .*: --pp-schedule dualpipev needs at least as many micro-batches"),
    (S.INTERLEAVED_1F1B, 4, 9, 2, None, r"micro-batches per step .* 2 rounds, and 9 is not a multiple of 2; use a multiple"),
    (S.INTERLEAVED_ZERO_BUBBLE, 3, 7, 2, None, r"micro-batches per step .* \(e\.g\. 6 or 9\)"),
    (S.INTERLEAVED_1F1B, 4, 8, 2, 7, "--pp 4 x --pp-virtual 2 = 8 stages for 7 blocks"),
    (S.LOOPED_BFS, 2, 4, 0, None, "--pp-virtual 0: stages per rank"),
    (S.GPIPE, 2, 0, 1, None, "micro-batches per step .*: 0;"),
]


@pytest.mark.parametrize(("schedule", "pp", "m", "v", "blocks", "message"), REFUSALS)
def test_refusals_are_one_line_naming_the_field(schedule: PipelineSchedule, pp: int, m: int, v: int,
                                                blocks: int | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        check_pipeline(schedule, pp, m, v, blocks)
    assert "\n" not in str(refused.value) and "; " in str(refused.value)

