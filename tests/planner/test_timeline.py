"""A rank's timeline (planner/timing/timeline.py, planner/timing/step_time.py): the overlap rule against its
closed form, waits, critical path and exposure, and the step time every estimate reads off it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware.registry import load_hardware
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.plan.schedule import accumulation
from planner.program.estimate import estimate
from planner.timing.step_time import Collectives, rank_timeline
from planner.timing.timeline import RankTimeline, Stream, Task, overlapped_s, run_segment

HW = load_hardware("h100-sxm")
PROBE = ModelConfig(family="llama", name="probe-llama", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=688,
                    vocab_size=4096, max_seq_len=256)
seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(compute=seconds, comm=seconds, slowdown=st.floats(min_value=0.0, max_value=1.0))
def test_compute_beside_a_collective_is_the_closed_form(compute: float, comm: float, slowdown: float) -> None:
    """Two tasks started together, compute slowed while the collective runs: the span is the
    compute plus ``overlapped_s``."""
    seg = run_segment("s", (Task("c", Stream.COMPUTE, compute), Task("n", Stream.COMMUNICATION, comm)), slowdown)
    assert seg.span_s == pytest.approx(compute + overlapped_s(compute, comm, slowdown), rel=1e-12, abs=1e-12)


def test_waits_order_and_critical_path() -> None:
    """A collective that must end before compute starts is exposed; one beside compute that it
    outlasts is on the critical path for the part it outlasts; streams run their tasks in order."""
    tasks = (Task("gather", Stream.COMMUNICATION, 1.0),
             Task("forward", Stream.COMPUTE, 2.0, ("gather",)),
             Task("prefetch", Stream.COMMUNICATION, 5.0, ("gather",)),
             Task("backward", Stream.COMPUTE, 1.0, ("forward", "prefetch")))
    seg = run_segment("s", tasks, slowdown=0.0)
    spans = {s.task.name: s for s in seg.spans}
    assert (spans["forward"].start_s, spans["forward"].end_s) == (1.0, 3.0)
    assert spans["backward"].start_s == 6.0 and seg.span_s == 7.0
    assert [s.task.name for s in seg.critical_path()] == ["gather", "prefetch", "backward"]


def test_a_task_that_waits_for_nothing_that_runs_is_refused() -> None:
    with pytest.raises(ValueError, match="never run"):
        run_segment("s", (Task("a", Stream.COMPUTE, 1.0, ("missing",)),), 0.0)


def test_repeated_micro_batches_count_their_segment() -> None:
    """Accumulation of 4: the first micro-batch and the three middle ones are two segments."""
    c = Collectives(before_forward_s=0.5, during_sync_backward_s=0.1)
    line = rank_timeline(accumulation(4), 1.0, 2.0, 0.25, c, slowdown=0.0)
    assert [s.repeats for s in line.segments] == [1, 3, 1]
    assert line.step_time_s == pytest.approx(4 * (0.5 + 1.0 + 2.0) + 0.25)
    assert line.busy_s(Stream.COMMUNICATION) == pytest.approx(4 * 0.6)
    assert line.exposed_s(Stream.COMMUNICATION) == pytest.approx(4 * 0.5)  # the reduce-scatter hides


def test_sync_only_on_the_last_micro_batch() -> None:
    """DDP's buckets are all-reduced beside the last backward only (``no_sync`` on the others)."""
    c = Collectives(during_sync_backward_s=3.0, after_sync_backward_s=1.0)
    line = rank_timeline(accumulation(4, sync_last=True), 1.0, 2.0, 0.0, c, slowdown=0.0)
    assert line.step_time_s == pytest.approx(4 * 3.0 + (3.0 - 2.0) + 1.0)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_estimates_read_the_step_time_off_the_timeline(stage: int) -> None:
    training = TrainConfig(seq_len=256, global_batch_size=64)
    est = estimate(PROBE, training, HW, Knobs(micro_batch_size=4, grad_accum_steps=2, data_parallel=8,
                                              zero_stage=stage, precision="bf16-mixed"))
    line = est.time.timeline
    assert line is not None and line.step_time_s == pytest.approx(est.step_time_s, rel=1e-12)
    compute = est.time.forward_s + est.time.backward_s + est.time.recompute_s + est.time.optimizer_s
    assert est.time.communication_s == pytest.approx(line.step_time_s - compute, abs=1e-15)
    assert est.time.communication_s > 0


def _walk(schedule_events: tuple, n: int, stage: int = 0) -> tuple:
    from planner.plan.schedule import Event, Phase, Schedule
    from planner.program.estimate import step_program

    training = TrainConfig(seq_len=256, global_batch_size=8 * n)
    knobs = Knobs(micro_batch_size=4, grad_accum_steps=n, data_parallel=2, zero_stage=stage, precision="fp32")
    program = step_program(PROBE, training, HW, knobs)
    events = tuple(Event(mb, phase) for mb, phase in schedule_events) + (Event(n - 1, Phase.OPTIMIZER),)
    schedule = Schedule(events=events, n_micro_batches=n)
    rank = program.busiest
    from planner.memory.step import simulate_step
    return simulate_step(rank.graph, rank.static, HW.round_alloc, program.units, schedule, record_trace=True), program


@pytest.mark.parametrize("stage", [0, 3])
def test_two_micro_batches_in_flight_hold_both_forwards(stage: int) -> None:
    """The one event loop runs any order of events (a pipeline's F0 F1 B0 B1): the second forward
    ends with the first one's saved activations still held, and the gradients the first backward
    allocates are added into by the second."""
    from planner.plan.schedule import Phase

    f, b = Phase.FORWARD, Phase.BACKWARD
    serial, program = _walk(((0, f), (0, b), (1, f), (1, b)), 2, stage)
    both, _ = _walk(((0, f), (1, f), (0, b), (1, b)), 2, stage)
    last = program.busiest.graph.order[-1]
    ends = [e for e in both.trace if e.phase is f and e.op == last]
    held = ends[1].live_bytes - ends[0].live_bytes
    assert held == pytest.approx(serial.activations_bytes + serial.logits_bytes, rel=0.02)
    assert both.peak.bytes > serial.peak.bytes
    assert both.peak.bytes - serial.peak.bytes <= held + 1


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 2), (4, 8)])
def test_a_pipelines_bubble_falls_out_of_the_ranks_waits(stages: int, micro_batches: int) -> None:
    """GPipe over ranks whose forwards and backwards take t and 2t: each stage waits for the one
    before it (forward) or after it (backward), so the step is (m + p - 1)(t + 2t) and each rank
    idles (p - 1)(3t): the bubble fraction (p - 1)/(m + p - 1) of Huang et al. 2019 (GPipe)."""
    t = 1.0
    tasks: list[Task] = []
    for mb in range(micro_batches):
        for rank in range(stages):
            after = (f"F{mb}.{rank - 1}",) if rank else ()
            tasks.append(Task(f"F{mb}.{rank}", Stream.COMPUTE, t, after, rank))
    for mb in range(micro_batches):
        for rank in reversed(range(stages)):
            after = (f"B{mb}.{rank + 1}",) if rank < stages - 1 else (f"F{micro_batches - 1}.{rank}",)
            tasks.append(Task(f"B{mb}.{rank}", Stream.COMPUTE, 2 * t, after, rank))
    line = RankTimeline(segments=(run_segment("step", tuple(tasks), slowdown=0.3),))
    assert line.step_time_s == pytest.approx((micro_batches + stages - 1) * 3 * t)
    for rank in range(stages):
        assert line.idle_s(rank) == pytest.approx((stages - 1) * 3 * t)
