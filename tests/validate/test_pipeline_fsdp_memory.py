"""The planner's per-rank memory of FSDP2 under a pipeline (``planner.parallel.fsdp_pipeline``)
against what torch 2.13 allocates, measured by the live-storage tracker on one pipeline rank of a
fake [pp, dp_shard] mesh (``validate.pipeline_fsdp.measure_fsdp_rank``; docs/pipeline_memory.md
section 9): each stage ``fully_shard``-ed over 2 ranks with ``reshard_after_forward=False`` (as
torchtitan runs FSDP2 under a pipeline), fp32 and the bf16 ``MixedPrecisionPolicy``, 4
micro-batches accumulated per step, the first, a middle and the last rank of GPipe, 1F1B and
Interleaved1F1B (two stages per rank). The model and its split are test_pipeline_memory's (the
same cases without FSDP2); the batch and the optimizer step, which the harness does not run, are
left out of both sides."""

from __future__ import annotations

from functools import cache

import pytest

torch = pytest.importorskip("torch")

from test_pipeline_memory import HW, MODEL, PP, SCHEDULES, TRAINING, M, T  # noqa: E402

from planner.memory.step import Phase  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.plan.parallel_dims import ParallelDims  # noqa: E402
from planner.program.estimate import step_program  # noqa: E402
from planner.program.step_program import StepProgram  # noqa: E402
from validate.pipeline import PipelineCase, StepRecord  # noqa: E402
from validate.pipeline_fsdp import measure_fsdp_rank  # noqa: E402

# the measurements are cached per module: every test of it on one xdist worker
pytestmark = pytest.mark.xdist_group("test_pipeline_fsdp_memory")

N = 2  # dp_shard: the data-parallel ranks each stage is sharded over
RANKS = (0, 1, PP - 1)
# LoopedBFS unshards its stages up front as Interleaved1F1B does: checked by hand (docs/pipeline_memory.md
# 9.5), left out of the suite for its time
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}
CASES = [(schedule, precision) for schedule in VIRTUAL for precision in ("fp32", "bf16-mixed")]


@cache
def _program(schedule: str, precision: str) -> StepProgram:
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=M, precision=precision, pp_schedule=schedule,
                  pp_virtual=VIRTUAL[schedule], parallel=ParallelDims.data_parallel_of(PP * N, 2, pp=PP))
    return step_program(MODEL, TRAINING.model_copy(update={"global_batch_size": M * N}), HW, knobs)


@cache
def _measured(schedule: str, precision: str, rank: int) -> StepRecord:
    """The rank's second step, as torch runs it."""
    case = PipelineCase(MODEL, pp=PP, v=VIRTUAL[schedule], schedule=SCHEDULES[schedule], n_microbatches=M, seq_len=T,
                        dp_shard=N, mixed_precision=precision == "bf16-mixed")
    return measure_fsdp_rank(case, rank).steps[-1]


def _walked(schedule: str, precision: str, rank: int) -> tuple[int, int]:
    """The planner's (peak before the optimizer step, bytes live when it starts), without the batch."""
    program = _program(schedule, precision)
    walk = program.walk(rank=program.ranks[rank], record_trace=True)
    data = program.ranks[rank].static.data_bytes
    peak = max(e.live_bytes for e in walk.trace if e.phase is not Phase.OPTIMIZER)
    end = next(e.live_bytes for e in walk.trace if e.phase is Phase.OPTIMIZER)
    return peak - data, end - data


@pytest.mark.parametrize(("schedule", "precision"), CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_every_rank_within_one_percent_of_torch(schedule: str, precision: str) -> None:
    """Measured: every case within 0.5%, the first rank to the byte (the gaps are the pipeline's
    own, the same bytes as test_pipeline_memory's cases without FSDP2)."""
    for rank in RANKS:
        step = _measured(schedule, precision, rank)
        theirs = step.peak_bytes - step.peak_categories.get("batch", 0)
        ours, _ = _walked(schedule, precision, rank)
        assert ours == pytest.approx(theirs, rel=0.01), (schedule, precision, rank, ours, theirs)
        if rank == 0:
            assert ours == theirs, (schedule, precision, ours, theirs)


@pytest.mark.parametrize(("schedule", "precision"), CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_the_step_ends_with_shards_and_sharded_gradients(schedule: str, precision: str) -> None:
    """After every stage's REDUCE_GRAD (one reduce-scatter per stage and step) the rank holds its
    sharded parameters, one sharded gradient per unit and its receive buffers, to the byte."""
    for rank in RANKS:
        step = _measured(schedule, precision, rank)
        _, end = _walked(schedule, precision, rank)
        assert end == step.live_after - step.categories_after["batch"], (schedule, precision, rank)
        assert step.categories_after["sharded_grads"] > 0 and step.categories_after["unsharded_params"] == 0

