"""What torch.distributed.pipelining allocates per rank (docs/pipeline_memory.md), measured by
validate.pipeline on one rank of a fake process group with the live-storage tracker.

Model: 4 blocks (one per stage at pp = 4), d_model 64, seq 32, micro-batch 1, vocab 512, so a
hidden state is h = 32·64·4 = 8 KiB and the logits are 32·512·4 = 64 KiB in fp32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from planner.model.config import ModelConfig  # noqa: E402
from validate.pipeline import PipelineCase, RankMeasurement, StepRecord, in_flight, measure_rank  # noqa: E402
from validate.tracker import rounded_bytes  # noqa: E402

# its module-scoped fixtures are built once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("test_pipeline_harness")

TINY = ModelConfig(family="llama", name="pp-tiny", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172,
                   vocab_size=512, max_seq_len=64)
T, D, V, FF, M = 32, 64, 512, 172, 4


def _hidden(bytes_per: int = 4) -> int:
    return rounded_bytes(T * D * bytes_per)


def _logits(bytes_per: int = 4) -> int:
    return rounded_bytes(T * V * bytes_per)


def _actions(step: StepRecord, kind: str, stage: int) -> list:
    return [a for a in step.actions if a.kind == kind and a.stage == stage]


@pytest.fixture(scope="module")
def one_f_one_b() -> dict[int, RankMeasurement]:
    case = PipelineCase(TINY, pp=4, schedule="Schedule1F1B", n_microbatches=M, seq_len=T)
    return {rank: measure_rank(case, rank) for rank in (0, 1, 3)}


@pytest.fixture(scope="module")
def zbv() -> RankMeasurement:
    return measure_rank(PipelineCase(TINY, pp=2, v=2, schedule="ScheduleZBVZeroBubble", n_microbatches=M,
                                     seq_len=T), 1)


def test_receive_buffers_one_per_microbatch_allocated_once(one_f_one_b: dict[int, RankMeasurement]) -> None:
    """stage.py:_setup_forward_recv_info / _create_grad_recv_info: one buffer per micro-batch,
    allocated at the first step's set-up and kept for the life of the stage."""
    for rank, run in one_f_one_b.items():
        fwd = 0 if rank == 0 else M * _hidden()
        bwd = 0 if rank == 3 else M * _hidden()
        first, second = run.steps
        assert (second.categories_after["fwd_recv"], second.categories_after["bwd_recv"]) == (fwd, bwd)
        init1, init2 = first.actions[0], second.actions[0]
        assert init1.kind == init2.kind == "init"
        assert init1.live_after - first.live_before == fwd + bwd
        assert init2.live_after == second.live_before == init2.peak_bytes  # nothing new in step 2


def test_after_a_step_only_params_grads_and_buffers_remain(one_f_one_b: dict[int, RankMeasurement]) -> None:
    for run in one_f_one_b.values():
        after = run.steps[1].categories_after
        assert after["grads"] == after["params"] == run.param_bytes
        assert after["other"] == after["outputs"] == after["loss"] == 0
        assert run.steps[1].live_after == sum(after.values())


def test_1f1b_holds_min_m_pp_minus_stage_microbatches(one_f_one_b: dict[int, RankMeasurement]) -> None:
    """schedules.py:Schedule1F1B: warm-up of min(m, pp - s) forwards; each forward adds the same bytes."""
    for rank, run in one_f_one_b.items():
        step = run.steps[1]
        assert max(in_flight(step)) == min(M, 4 - rank)
        forwards = _actions(step, "F", rank)
        added = {f.added for f in forwards}
        assert len(added) == 1
        per_microbatch = added.pop()
        warmup = forwards[: min(M, 4 - rank)]
        base = step.actions[0].live_after
        if rank < 3:  # the warm-up forwards follow one another: k of them held
            assert [f.live_after - base for f in warmup] == [per_microbatch * (k + 1) for k in range(len(warmup))]
            assert forwards[0].categories["outputs"] == _hidden()  # the stage output kept for backward
    assert one_f_one_b[0].steps[1].peak_bytes > one_f_one_b[1].steps[1].peak_bytes


def test_last_stage_holds_logits_and_fp32_log_probs(one_f_one_b: dict[int, RankMeasurement]) -> None:
    step = one_f_one_b[3].steps[1]
    forward, loss, backward = _actions(step, "F", 3)[0], _actions(step, "L", 3)[0], _actions(step, "B", 3)[0]
    assert forward.categories["outputs"] == _logits()  # fwd_cache: the stage output (logits)
    assert loss.live_after - forward.live_after == _logits(4) + 2 * 512  # log-probs, a scalar, the loss
    assert loss.categories["loss"] == 512
    # after its backward: no output cached; the detached logits still held by Schedule1F1B's local `output`
    assert backward.categories["outputs"] == 0 and backward.categories["other"] == _logits()
    assert backward.categories["input_grads"] == _hidden()


def test_last_stage_bf16_keeps_bf16_logits_and_fp32_log_probs() -> None:
    run = measure_rank(PipelineCase(TINY, pp=2, schedule="Schedule1F1B", n_microbatches=2, seq_len=T,
                                    dtype=torch.bfloat16), 1)
    step = run.steps[1]
    forward, loss = _actions(step, "F", 1)[0], _actions(step, "L", 1)[0]
    assert forward.categories["outputs"] == _logits(2)
    assert loss.live_after - forward.live_after == _logits(4) + 2 * 512
    assert step.categories_after["fwd_recv"] == 2 * _hidden(2)


def test_gpipe_holds_every_microbatch() -> None:
    run = measure_rank(PipelineCase(TINY, pp=2, schedule="ScheduleGPipe", n_microbatches=M, seq_len=T), 0)
    step = run.steps[1]
    assert max(in_flight(step)) == M
    forwards = _actions(step, "F", 0)
    per_microbatch = forwards[0].live_after - step.actions[0].live_after
    assert forwards[-1].live_after - step.actions[0].live_after == M * per_microbatch


def test_split_backward_keeps_graph_and_output_grads_until_weight(zbv: RankMeasurement) -> None:
    """_backward.py:stage_backward_input (retain_graph=True, input .grad kept) and
    stage_backward_weight: I adds the input gradient and the gradients of every weight op's output
    (the down projection's is the received gradient itself); W frees them with the activations."""
    step = zbv.steps[1]
    weight_outputs = [D, D // 2, D // 2, D, FF, FF, D, D]  # q, k, v, o, gate, up, two norms
    weight_state = sum(rounded_bytes(T * n * 4) for n in weight_outputs)
    for stage in zbv.stages:
        for action in _actions(step, "I", stage):
            assert action.added == _hidden() + weight_state
            assert action.categories["weight_state"] >= weight_state
        forward = _actions(step, "F", stage)[1]
        weight = _actions(step, "W", stage)[1]  # not the first: gradients already exist
        shared = _hidden() if stage + 1 in zbv.stages else 0  # the output lives on as the next local stage's input
        assert -weight.added == forward.added + weight_state - shared
    assert step.categories_after["weight_state"] == 0
    assert step.categories_after["input_grads"] == M * _hidden()  # recv buffers' .grad, cleared next step


def test_dynamic_metadata_runs_a_forward_at_the_first_step_only() -> None:
    case = PipelineCase(TINY, pp=2, schedule="Schedule1F1B", n_microbatches=2, seq_len=T, metadata="dynamic")
    run = measure_rank(case, 1)
    init1, init2 = run.steps[0].actions[0], run.steps[1].actions[0]
    assert init1.peak_bytes > init1.live_after  # stage.py:_forward/_backward_metadata_inference transient
    assert init1.live_after - run.steps[0].live_before == 2 * _hidden()
    assert init2.peak_bytes == init2.live_after == run.steps[1].live_before
