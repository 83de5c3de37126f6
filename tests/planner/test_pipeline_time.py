"""The time of a pipeline step (planner/timing/pipeline_time.py): torch's orders run on the timeline
with a pipeline's dependencies, and the bubble that falls out of them checked against the
published analyses where their assumptions hold (uniform stages, sends of no time unless said):

- GPipe and 1F1B: bubble time (p - 1)(tf + tb), "bubble time fraction" (p - 1) / m of the ideal
  time, so (p - 1) / (m + p - 1) of the step (Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, sec. 2.2.1);
- interleaved 1F1B with v chunks per rank: (p - 1) / (v m) (ibid., sec. 2.2.2); looped BFS the
  same (Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism", arXiv 2211.05953);
- torch's interleaved zero bubble (ZB1P, per its docstring): ZB-H1's bubble (p - 1)(TF + TB - TW)
  with TB the input gradient (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
  arXiv 2401.10241, sec. 2.1), i.e. (p - 1) / (3 m) at TF = TB = TW (the authors' table,
  huggingface.co/spaces/sail/pipeline-parallelism-with-controllable-memory);
- ZB-V: zero bubble inside each rank's span when TF = TB = TW (ibid. sec. 6; torch's
  ``ScheduleZBVZeroBubble`` docstring): the ranks' only idle is the start-up offset of the
  parallelogram, which the paper's optimizer post-validation lets the next step absorb.
"""

from __future__ import annotations

import pytest

from planner.errors import ConfigError
from planner.plan.pipeline_schedules import PipelineSchedule, check_pipeline, rank_stages
from planner.timing.pipeline_time import StageTime, pipeline_time
from planner.timing.timeline import Stream

S = PipelineSchedule


def _per_rank(f: float, i: float, w: float, v: int) -> StageTime:
    """Stages of a rank's ``f, i, w`` seconds split evenly over its ``v`` chunks."""
    return StageTime(f / v, i / v, w / v)


def _internal_gaps(result, pp: int) -> list[float]:  # noqa: ANN001
    """Each rank's idle between its first start and last end."""
    spans = result.timeline.segments[0].spans
    gaps = []
    for rank in range(pp):
        mine = [s for s in spans if s.task.rank == rank and s.task.stream is Stream.COMPUTE]
        gaps.append(max(s.end_s for s in mine) - min(s.start_s for s in mine) - result.busy_s[rank])
    return gaps


@pytest.mark.parametrize("schedule", [S.GPIPE, S.ONE_F_ONE_B])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_gpipe_and_1f1b_bubble_is_narayanans(schedule: PipelineSchedule, pp: int) -> None:
    tf, ti, tw = 1.0, 1.3, 0.7
    for m in range(pp, 13):
        r = pipeline_time(schedule, pp, m, StageTime(tf, ti, tw))
        assert r.step_time_s == pytest.approx((m + pp - 1) * (tf + ti + tw))
        assert r.bubble_overhead == pytest.approx((pp - 1) / m)
        assert r.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
        assert r.idle_s == pytest.approx([(pp - 1) * (tf + ti + tw)] * pp)


@pytest.mark.parametrize("schedule", [S.INTERLEAVED_1F1B, S.LOOPED_BFS])
@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_looped_schedules_divide_the_bubble_by_v(schedule: PipelineSchedule, pp: int, v: int) -> None:
    """(p - 1) / (v m) wherever torch takes m >= pp; with fewer micro-batches than ranks the
    pipeline never fills and the bubble is no smaller."""
    for m in range(1, 13):
        try:
            check_pipeline(schedule, pp, m, v)
        except ConfigError:
            continue
        r = pipeline_time(schedule, pp, m, _per_rank(1.0, 1.2, 0.8, v), virtual=v)
        if m >= pp:
            assert r.bubble_overhead == pytest.approx((pp - 1) / (v * m)), m
        else:
            assert r.bubble_overhead >= (pp - 1) / (v * m) - 1e-12, m


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize(("tf", "ti", "tw"), [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.0, 0.5), (1.2, 1.0, 0.9)])
def test_interleaved_zero_bubble_is_zb_h1(pp: int, v: int, tf: float, ti: float, tw: float) -> None:
    """Every rank idles (p - 1)(TF + TB - TW) / v (per-rank times, TB the input gradient), where
    TW <= min(TF, TB): a deferred W fills no more than the gap it was deferred into."""
    for m in (pp, 2 * pp, 3 * pp):
        r = pipeline_time(S.INTERLEAVED_ZERO_BUBBLE, pp, m, _per_rank(tf, ti, tw, v), virtual=v)
        assert r.idle_s == pytest.approx([(pp - 1) * (tf + ti - tw) / v] * pp)
        if tf == ti == tw and v == 1:
            assert r.bubble_overhead == pytest.approx((pp - 1) / (3 * m))


@pytest.mark.parametrize(("tf", "ti", "tw"), [(1.0, 1.5, 1.2), (1.2, 1.0, 1.1), (1.0, 0.8, 0.9), (1.0, 0.5, 2.0)])
def test_zero_bubble_with_a_long_weight_gradient(tf: float, ti: float, tw: float) -> None:
    """Outside ZB-H1's figure (TW > TF or TW > TB) the order leaves (p - 1)(TF + TB - min(TF, TB, TW))
    per rank: measured here, not published; still less than 1F1B's (p - 1)(TF + TB + TW)."""
    pp = 4
    zb = pipeline_time(S.INTERLEAVED_ZERO_BUBBLE, pp, 8, StageTime(tf, ti, tw))
    one_f_one_b = pipeline_time(S.ONE_F_ONE_B, pp, 8, StageTime(tf, ti, tw))
    assert zb.idle_s == pytest.approx([(pp - 1) * (tf + ti - min(tf, ti, tw))] * pp)
    assert max(zb.idle_s) < max(one_f_one_b.idle_s) == pytest.approx((pp - 1) * (tf + ti + tw))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_zbv_has_no_bubble_inside_a_rank_when_f_b_w_are_equal(pp: int) -> None:
    """Each rank runs without a gap from its first action to its last; the idle left is the
    start-up offset, (p - 1) chunk forwards per rank (rank r starts r chunk forwards late and
    ends p - 1 - r early), the least any order can leave. Unequal times open gaps."""
    chunk = StageTime(0.5, 0.5, 0.5)
    for m in (2 * pp, 3 * pp, 4 * pp):
        r = pipeline_time(S.ZBV_ZERO_BUBBLE, pp, m, chunk, virtual=2)
        assert _internal_gaps(r, pp) == pytest.approx([0.0] * pp, abs=1e-9)
        assert r.idle_s == pytest.approx([(pp - 1) * chunk.forward_s] * pp)
    uneven = pipeline_time(S.ZBV_ZERO_BUBBLE, pp, 4 * pp, StageTime(0.5, 0.75, 0.6), virtual=2)
    assert min(uneven.idle_s) > (pp - 1) * 0.5


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_dualpipev_runs_its_overlapped_pairs_one_after_the_other(pp: int) -> None:
    """torch runs an OVERLAP_F_B's forward and full backward in turn (no custom function): each
    rank's compute is m forwards and m full backwards of both its stages, and at TF = TB = TW its
    idle equals ZB-V's start-up offset. (DeepSeek's figure (PP/2 - 1)(F&B + B - 3W) assumes the
    pair overlaps its communication, which is not modelled here.)"""
    chunk = StageTime(0.5, 0.5, 0.5)
    for m in (2 * pp, 3 * pp):
        r = pipeline_time(S.DUALPIPEV, pp, m, chunk, virtual=2)
        assert r.busy_s == pytest.approx([2 * m * 1.5] * pp)
        assert r.idle_s == pytest.approx([(pp - 1) * chunk.forward_s] * pp)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_sends_cross_ranks_only(pp: int) -> None:
    """GPipe's fill and drain each cross p - 1 sends: the step grows by 2 (p - 1) x p2p. The V
    schedules send nothing at their turn (stages pp - 1 and pp share the last rank)."""
    c, m = 0.1, 2 * pp
    base = pipeline_time(S.GPIPE, pp, m, StageTime(1.0, 1.2, 0.8))
    sent = pipeline_time(S.GPIPE, pp, m, StageTime(1.0, 1.2, 0.8), p2p_s=c)
    assert sent.step_time_s - base.step_time_s == pytest.approx(2 * (pp - 1) * c)
    for schedule in (S.ZBV_ZERO_BUBBLE, S.DUALPIPEV):
        r = pipeline_time(schedule, pp, m, StageTime(0.5, 0.5, 0.5), p2p_s=c, virtual=2)
        sends = [s for s in r.timeline.segments[0].spans if s.task.stream is Stream.COMMUNICATION]
        assert len(sends) == 2 * m * (2 * pp - 2)  # a forward and a gradient over each boundary but the turn
        assert r.timeline.busy_s(Stream.COMMUNICATION) == pytest.approx(len(sends) * c)


def test_each_stage_is_timed_with_its_own_times() -> None:
    """A slow stage: every rank's compute is its stages' times x m, and GPipe's span is set by the
    slowest stage (m of its forwards and backwards plus one pass through the others)."""
    pp, m = 3, 6
    times = (StageTime(1.0, 1.0, 1.0), StageTime(2.0, 2.0, 2.0), StageTime(1.0, 1.0, 1.0))
    r = pipeline_time(S.GPIPE, pp, m, times)
    assert r.busy_s == pytest.approx([m * 3.0, m * 6.0, m * 3.0])
    assert r.step_time_s == pytest.approx(m * 6.0 + 2 * 3.0)
    v_times = tuple(StageTime(0.1 * (s + 1), 0.1, 0.1) for s in range(2 * pp))
    v = pipeline_time(S.ZBV_ZERO_BUBBLE, pp, 2 * pp, v_times, virtual=2)
    for rank, stages in enumerate(rank_stages(S.ZBV_ZERO_BUBBLE, pp, 2)):
        assert v.busy_s[rank] == pytest.approx(2 * pp * sum(v_times[s].forward_s + 0.2 for s in stages))
    with pytest.raises(ValueError, match="3 stage times for 6 stages"):
        pipeline_time(S.ZBV_ZERO_BUBBLE, pp, 2 * pp, times, virtual=2)


def test_every_order_torch_accepts_runs_to_the_end() -> None:
    """No order of the grid waits for an action that never comes (a deadlock would raise)."""
    for schedule in S:
        for pp in (2, 3, 4):
            for v in (1, 2, 3):
                for m in range(1, 13):
                    try:
                        check_pipeline(schedule, pp, m, v)
                    except ConfigError:
                        continue
                    r = pipeline_time(schedule, pp, m, _per_rank(1.0, 1.1, 0.9, v), p2p_s=0.05, virtual=v)
                    assert r.busy_s == pytest.approx([m * 3.0] * pp)
                    assert 0.0 < r.bubble_fraction < 1.0


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), [
    ("1f1b", 4, 1, 64), ("1f1b", 3, 1, 50), ("interleaved-1f1b", 4, 2, 64), ("interleaved-1f1b", 2, 3, 40),
    ("dualpipev", 3, 2, 45)])
def test_a_long_step_timed_from_two_short_ones_is_the_whole_step(schedule: str, pp: int, v: int, m: int) -> None:
    """Uneven stages, sends and the overlap slowdown: the extrapolated span and every rank's
    compute and idle equal the whole timeline's: to the digit for the looped and V schedules, within
    0.5% for 1F1B (0.21% in these cases), whose steady state under the overlap slowdown settles slowly (the span added per
    micro-batch still falls by 1e-5 of itself after 60 of them). The search ranks with this figure;
    a plan's reported time is the whole timeline's (``estimate``)."""
    times = tuple(StageTime(forward_s=1.0 + 0.13 * s, backward_input_s=1.1 + 0.07 * (s % 3), backward_weight_s=0.9)
                  for s in range(pp * v))
    sched = PipelineSchedule(schedule)
    whole = pipeline_time(sched, pp, m, times, p2p_s=0.17, virtual=v, slowdown=0.1)
    fast = pipeline_time(sched, pp, m, times, p2p_s=0.17, virtual=v, slowdown=0.1, whole=False)
    assert fast.timeline is None and whole.timeline is not None
    rel = 5e-3 if sched is PipelineSchedule.ONE_F_ONE_B else 1e-9
    assert fast.step_time_s == pytest.approx(whole.step_time_s, rel=rel)
    assert fast.busy_s == pytest.approx(whole.busy_s, rel=1e-9)
    assert fast.idle_s == pytest.approx(whole.idle_s, rel=20 * rel, abs=1e-9)
