"""FSDP2 under a pipeline (``planner.parallel.fsdp_pipeline``; measured in docs/pipeline_memory.md
section 9, the memory checked against torch in tests/validate/test_pipeline_fsdp_memory.py): what
it costs in time (each stage all-gathered once per step at its first forward, one reduce-scatter
after its last backward, priced by the ring model and placed on the rank's timeline), what the
report says, and what is still refused."""

from __future__ import annotations

import pytest
from cli_helpers import run_plan

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.memory.types import Phase
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.program.estimate import estimate, step_program
from planner.program.step_program import StepProgram, placed
from planner.timing.timeline import Stream, overlapped_s

HW = load_hardware("h100-sxm")
MODEL = ModelConfig(family="llama", name="pp-fsdp", n_layers=8, d_model=512, n_heads=8, n_kv_heads=4, d_ff=1376,
                    vocab_size=4096, max_seq_len=512)
PP, N = 2, 4  # pipeline ranks, FSDP2 ranks per stage


def _program(m: int, schedule: str = "1f1b", virtual: int = 1, stage: int = 3,
             precision: str = "bf16-mixed") -> tuple[StepProgram, Knobs, TrainConfig]:
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=m, precision=precision, pp_schedule=schedule,
                  pp_virtual=virtual, parallel=ParallelDims.data_parallel_of(PP * N, stage, pp=PP))
    training = TrainConfig(seq_len=512, global_batch_size=m * N)
    return step_program(MODEL, training, HW, knobs), knobs, training


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_each_stage_gathers_and_reduce_scatters_once_per_step(schedule: str, virtual: int) -> None:
    """Per stage of a rank: its all-gathers around its first forward, its reduce-scatters after its
    last backward, however many micro-batches the step accumulates (the communication stream's
    work is the same at 4 and 8)."""
    busy = {}
    for m in (4, 8):
        program, _, _ = _program(m, schedule, virtual)
        rank = program.ranks[0]
        timeline = placed(program.compute_time(frozenset(), rank), rank, HW).timeline
        assert timeline is not None
        names = [s.task.name for seg in timeline.segments for s in seg.spans if s.task.stream is Stream.COMMUNICATION]
        once = [part.once for part in (rank, *rank.others)]
        # the root's all-gather before (a middle stage's root holds nothing), the blocks' beside
        assert sum(n.startswith("forward") for n in names) == sum((o.before_forward_s > 0) + 1 for o in once)
        assert sum(n.startswith("backward") and n.endswith("after") for n in names) == virtual
        assert once[0].before_forward_s > 0 and all(o.during_forward_s > 0 and o.after_sync_backward_s > 0 for o in once)
        assert rank.collectives.none  # nothing per micro-batch
        busy[m] = timeline.busy_s(Stream.COMMUNICATION)
        assert busy[m] == pytest.approx(sum(o.before_forward_s + o.during_forward_s + o.after_sync_backward_s
                                            for o in once))
    assert busy[4] == pytest.approx(busy[8])


def test_what_the_first_rank_exposes_is_its_root_gather_the_blocks_beside_and_the_reduce_scatter() -> None:
    """1F1B's first rank: nothing hides the root's all-gather before its first forward, the blocks'
    all-gathers run beside that forward (``overlapped_s``: compute slowed beside them), and the
    reduce-scatters after its last backward (``perform_reduce_grad``'s final callback waits for
    them); the pipelined step adds the most any rank's collectives add."""
    program, knobs, training = _program(8)
    rank = program.ranks[0]
    compute = program.compute_time(frozenset(), rank)
    forward_s = compute.forward_s / rank.schedule.count(Phase.FORWARD)  # one micro-batch's
    once = rank.once
    expected = (once.before_forward_s + overlapped_s(forward_s, once.during_forward_s, HW.overlap_compute_slowdown)
                + once.after_sync_backward_s)
    assert placed(compute, rank, HW).communication_s == pytest.approx(expected)
    result = estimate(MODEL, training, HW, knobs)
    exposed = max(placed(program.compute_time(frozenset(), r), r, HW).communication_s for r in program.ranks)
    assert result.time.communication_s == pytest.approx(exposed)


def test_zero_2_and_zero_3_run_alike_under_a_pipeline() -> None:
    """torchtitan keeps reshard_after_forward=False under pipeline parallelism whatever the
    sharding: both stages price one plan, described so."""
    two, knobs, training = _program(4, stage=2)
    three, _, _ = _program(4, stage=3)
    assert [two.walk(rank=r).peak.bytes for r in two.ranks] == [three.walk(rank=r).peak.bytes for r in three.ranks]
    code, out, err = run_plan("--model", "tiny-llama", "--gpus", "8", "--pp", "2", "--zero-stage", "3", "--tp", "2",
                              "--micro-batch", "1", "--precision", "bf16-mixed", "--checkpoint", "none")
    assert code == 0, err
    assert "FSDP2 under a pipeline" in " ".join(out.split())


@pytest.mark.parametrize(("schedule", "virtual", "words"), [
    ("interleaved-zero-bubble", 2, ("--pp-schedule interleaved-zero-bubble: splits", "not measured under FSDP2")),
    ("zbv-zero-bubble", 2, ("--pp-schedule zbv-zero-bubble: splits", "--pp-schedule gpipe")),
    ("dualpipev", 2, ("--pp-schedule dualpipev: splits", "--zero-stage 0/1")),
    ("interleaved-1f1b", 4, ("--pp-virtual 4: stages per rank", "use --pp-virtual 3 or fewer")),
])
def test_what_fsdp2_under_a_pipeline_still_refuses(schedule: str, virtual: int, words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as error:
        _program(8, schedule, virtual)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message


# docs/pipeline_memory.md 9.3: torch's peaks (batch included) on the doc model, dp_shard 2, m 8,
# measured by validate.pipeline_fsdp: (first rank, last rank)
DOC_MODEL = ModelConfig(family="llama", name="pp-doc", n_layers=8, d_model=128, n_heads=4, n_kv_heads=2, d_ff=344,
                        vocab_size=2048, max_seq_len=64)
MEASURED = {
    ("gpipe", 2, "fp32"): (28_940_288, 37_339_648), ("gpipe", 2, "bf16-mixed"): (17_879_040, 24_019_456),
    ("1f1b", 2, "fp32"): (15_710_208, 15_002_112), ("1f1b", 2, "bf16-mixed"): (10_878_976, 11_250_176),
    ("interleaved-1f1b", 2, "fp32"): (17_647_616, 16_824_832),
    ("interleaved-1f1b", 2, "bf16-mixed"): (11_849_728, 12_163_584),
    ("gpipe", 4, "fp32"): (16_220_160, 24_619_520), ("gpipe", 4, "bf16-mixed"): (10_414_080, 16_554_496),
    ("1f1b", 4, "fp32"): (12_177_408, 10_072_576), ("1f1b", 4, "bf16-mixed"): (8_022_016, 7_692_800),
    ("interleaved-1f1b", 4, "fp32"): (15_013_888, 12_577_280),
    ("interleaved-1f1b", 4, "bf16-mixed"): (9_398_272, 8_948_224),
}


@pytest.mark.parametrize(("schedule", "pp", "precision"), sorted(MEASURED))
def test_the_documented_measurements_within_half_a_percent(schedule: str, pp: int, precision: str) -> None:
    """The planner against section 9.3's table (another model size, pp 2 and 4, 8 micro-batches):
    the first and last ranks within 0.4% (the first of GPipe to the byte)."""
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, precision=precision, pp_schedule=schedule,
                  pp_virtual=virtual, parallel=ParallelDims.data_parallel_of(pp * 2, 2, pp=pp))
    program = step_program(DOC_MODEL, TrainConfig(seq_len=64, global_batch_size=16, optimizer="sgd"),
                           load_hardware("cpu"), knobs)
    for rank, theirs in zip((0, pp - 1), MEASURED[schedule, pp, precision], strict=True):
        walk = program.walk(rank=program.ranks[rank], record_trace=True)
        ours = max(e.live_bytes for e in walk.trace if e.phase is not Phase.OPTIMIZER)
        assert ours == pytest.approx(theirs, rel=0.005), (rank, ours, theirs)
