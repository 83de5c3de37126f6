"""A bounded schedule's long step walked over a few of its micro-batches
(``planner.plan.pipeline_plan.walked_micro_batches``) peaks exactly where the whole step does, on
every rank: its steady state repeats, so the micro-batches left out add nothing new. The
micro-batches it counts stay the step's (``Event.repeats``)."""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.memory.step import Phase
from planner.model.config import ModelConfig, TrainConfig
from planner.plan import pipeline_plan
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.plan.pipeline_plan import BOUNDED
from planner.plan.pipeline_schedules import PipelineSchedule
from planner.program.estimate import step_program

HW = load_hardware("h100-sxm")
MODEL = ModelConfig(family="llama", name="pp-walk", n_layers=12, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172,
                    vocab_size=512, max_seq_len=64, attention="eager")
CASES = [  # schedule, pp, v, micro-batches, data-parallel degree, checkpointed blocks
    ("1f1b", 4, 1, 48, 1, ()), ("1f1b", 8, 1, 64, 1, (2, 9)), ("interleaved-1f1b", 4, 2, 48, 1, ()),
    ("1f1b", 2, 1, 40, 2, (0, 5)), ("1f1b", 3, 1, 31, 1, tuple(range(12))),
    ("interleaved-1f1b", 2, 2, 32, 1, ()), ("interleaved-1f1b", 3, 2, 36, 2, (1, 2, 7)),
    ("dualpipev", 2, 2, 28, 1, ()),
]


def _knobs(schedule: str, pp: int, v: int, m: int, dp: int, blocks: tuple[int, ...]) -> tuple[Knobs, TrainConfig]:
    training = TrainConfig(seq_len=32, global_batch_size=m * dp)
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=m, precision="bf16-mixed", checkpoint_blocks=blocks,
                  parallel=ParallelDims.data_parallel_of(pp * dp, 0, pp=pp), pp_schedule=schedule, pp_virtual=v)
    return knobs, training


@pytest.mark.parametrize(("schedule", "pp", "v", "m", "dp", "blocks"), CASES,
                         ids=[f"{c[0]}-pp{c[1]}-m{c[3]}-dp{c[4]}" for c in CASES])
def test_a_long_step_walked_short_peaks_as_the_whole_step(monkeypatch: pytest.MonkeyPatch, schedule: str, pp: int,
                                                          v: int, m: int, dp: int, blocks: tuple[int, ...]) -> None:
    knobs, training = _knobs(schedule, pp, v, m, dp, blocks)
    assert pipeline_plan.walked_micro_batches(PipelineSchedule(schedule), pp, m, v) < m  # the case is shortened
    short = step_program(MODEL, training, HW, knobs)
    short_walks = [short.walk(rank=r) for r in short.ranks]
    monkeypatch.setattr(pipeline_plan, "walked_micro_batches", lambda schedule, pp, m, virtual=1: m)
    whole = step_program(MODEL, training, HW, knobs)
    for r, (a, b) in enumerate(zip(whole.ranks, short.ranks, strict=True)):
        assert a.schedule.count(Phase.FORWARD) == b.schedule.count(Phase.FORWARD) == m * v
        assert a.schedule.count(Phase.BACKWARD) == b.schedule.count(Phase.BACKWARD)
        assert len(b.schedule.events) < len(a.schedule.events)
        walk = whole.walk(rank=a)
        assert short_walks[r].peak.bytes == walk.peak.bytes, (r, short_walks[r].peak, walk.peak)
        assert short_walks[r].recomputed_ops == walk.recomputed_ops


def test_schedules_holding_every_micro_batch_are_walked_whole() -> None:
    for schedule in set(PipelineSchedule) - BOUNDED:
        assert pipeline_plan.walked_micro_batches(schedule, 4, 400, 2) == 400
    assert pipeline_plan.walked_micro_batches(PipelineSchedule.ONE_F_ONE_B, 4, 14, 1) == 14  # short: whole
