"""The planner's per-rank memory of a pipeline-parallel step against what torch 2.13's
``torch.distributed.pipelining`` allocates, measured by the live-storage tracker on one rank of a
fake process group (``validate.pipeline``): the first, a middle and the last stage, GPipe and
1F1B, fp32 and bf16, within 1% of the step's peak (the batch and the optimizer, which the harness
does not run, left out of both)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hardware.registry import load_hardware  # noqa: E402
from planner.memory.step import Phase  # noqa: E402
from planner.model.config import ModelConfig, TrainConfig  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.plan.parallel_dims import ParallelDims  # noqa: E402
from planner.program.estimate import estimate, step_program  # noqa: E402
from validate.pipeline import PipelineCase, measure_rank  # noqa: E402

HW = load_hardware("cpu")
M, T, PP = 4, 32, 4
MODEL = ModelConfig(family="llama", name="pp-tiny", n_layers=8, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172,
                    vocab_size=512, max_seq_len=64, attention="eager")
TRAINING = TrainConfig(seq_len=T, global_batch_size=M, optimizer="sgd")
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
DTYPES = {"fp32": torch.float32, "bf16-true": torch.bfloat16}


def _knobs(schedule: str, precision: str, layers: tuple[int, ...] = ()) -> Knobs:
    return Knobs(micro_batch_size=1, grad_accum_steps=M, precision=precision,
                 parallel=ParallelDims.data_parallel_of(PP, 0, pp=PP), pp_schedule=schedule, pp_layers=layers)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("layers", [(), (3, 2, 2, 1)], ids=["even", "uneven"])
def test_every_rank_within_one_percent_of_torch(request: pytest.FixtureRequest, schedule: str, precision: str, layers: tuple[int, ...]) -> None:
    if (schedule, precision, layers) == ("1f1b", "bf16-true", (3, 2, 2, 1)):
        # a one-block last stage in bf16 is 7,168 B (1.06%) over at its last backward: an open gap
        # in the last stage's logits/loss buffers, kept visible rather than hidden by a wider bound
        request.applymarker(pytest.mark.xfail(strict=True, reason="bf16 one-block last stage: +1.06%"))
    program = step_program(MODEL, TRAINING, HW, _knobs(schedule, precision, layers))
    case = PipelineCase(MODEL, pp=PP, schedule=SCHEDULES[schedule], n_microbatches=M, seq_len=T,
                        dtype=DTYPES[precision], layers_per_stage=list(layers) or None)
    for rank in (0, 1, PP - 1):
        walk = program.walk(rank=program.ranks[rank], record_trace=True)
        ours = max(e.live_bytes for e in walk.trace if e.phase is not Phase.OPTIMIZER)
        ours -= program.ranks[rank].static.data_bytes
        step = measure_rank(case, rank).steps[-1]
        theirs = step.peak_bytes - step.peak_categories.get("batch", 0)
        assert ours == pytest.approx(theirs, rel=0.01), (rank, ours, theirs)


def test_the_estimate_reports_every_stage_and_the_busiest() -> None:
    """``estimate`` prices each stage: its blocks, peak and share of the span; the plan's memory is
    the busiest stage's, the bubble what the pipeline leaves idle."""
    result = estimate(MODEL, TRAINING, HW, _knobs("1f1b", "fp32", (3, 2, 2, 1)))
    assert [(s.first_block, s.last_block) for s in result.stages] == [(0, 2), (3, 4), (5, 6), (7, 7)]
    assert result.memory.peak_allocated_bytes == max(s.peak_allocated_bytes for s in result.stages)
    assert all(s.idle_s > 0 for s in result.stages) and result.time.pipeline_bubble_s > 0
    assert result.step_time_s >= max(s.busy_s + s.idle_s for s in result.stages)
