"""Predicted peak memory vs the live-storage tracker over real PyTorch steps (fake tensors).

The tracker (validate.tracker) records every storage the reference model's steady-state
optimizer step allocates, rounded to CUDA's 512-byte blocks (docs/references.md, "Measuring memory
without a GPU"). The issue's bound is 3%; the planner is built to match far closer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
# the peak is all these tests read: simulate_step skips its FLOP count (tests/conftest.py)

from hardware.registry import load_hardware  # noqa: E402
from planner.model.config import ModelConfig, TrainConfig  # noqa: E402
from planner.model.sources import resolve  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.program.estimate import estimate  # noqa: E402
from validate.simulate import simulate_step  # noqa: E402

TOLERANCE = 0.03  # issue 2: within 3% of the tracker
HW = load_hardware("h100-sxm")

SMALL = ModelConfig(family="llama", name="small-llama", n_layers=4, d_model=256, n_heads=8, n_kv_heads=4,
                    d_ff=688, vocab_size=2048, max_seq_len=512)
SMALL_GPT2 = ModelConfig(family="gpt2", name="small-gpt2", n_layers=4, d_model=256, n_heads=4, d_ff=1024,
                         vocab_size=2048, max_seq_len=512, attention="eager", dropout=0.1)
PLACEMENTS = {"none": (), "early": (0, 1), "late": (2, 3), "all": (0, 1, 2, 3)}


def _compare(model: ModelConfig, training: TrainConfig, knobs: Knobs) -> tuple[int, int]:
    measured = simulate_step(model, training, knobs, flops=False).peak_allocated_bytes
    predicted = estimate(model, training, HW, knobs).memory.peak_allocated_bytes
    return predicted, measured


# Every precision with every placement; the optimizer implementation alternates between them, so
# each precision and each placement runs with both foreach and fused (pairwise: 12 cases where the
# full 3 x 4 x 2 product took 24, twice the CPU for no pair it did not already cover).
SMALL_LLAMA_CASES = [pytest.param(precision, placement, ("foreach", "fused")[(i + j) % 2],
                                  id=f"{precision}-{placement}-{('foreach', 'fused')[(i + j) % 2]}")
                     for i, precision in enumerate(["fp32", "bf16-true", "bf16-mixed"])
                     for j, placement in enumerate(PLACEMENTS)]


@pytest.mark.parametrize(("precision", "placement", "impl"), SMALL_LLAMA_CASES)
def test_small_llama_peak_matches_tracker(precision: str, placement: str, impl: str) -> None:
    training = TrainConfig(seq_len=256, global_batch_size=8, optimizer_impl=impl)
    knobs = Knobs(micro_batch_size=4, grad_accum_steps=2, precision=precision, checkpoint_blocks=PLACEMENTS[placement])
    predicted, measured = _compare(SMALL, training, knobs)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


# every placement once, the precisions alternating (each precision with early and late placements)
GPT2_EAGER_CASES = [(("fp32", "bf16-true")[i % 2], placement) for i, placement in enumerate(PLACEMENTS)]


@pytest.mark.parametrize(("precision", "placement"), GPT2_EAGER_CASES)
def test_gpt2_eager_dropout_peak_matches_tracker(precision: str, placement: str) -> None:
    """Korthikanti's setting (eager attention, dropout) with GPT-2 blocks, one micro-batch."""
    training = TrainConfig(seq_len=256, global_batch_size=4, optimizer_impl="foreach")
    knobs = Knobs(micro_batch_size=4, precision=precision, checkpoint_blocks=PLACEMENTS[placement])
    predicted, measured = _compare(SMALL_GPT2, training, knobs)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


def test_placement_matters_and_planner_agrees() -> None:
    """Checkpointing late blocks peaks higher than early ones (their recompute runs while the
    earlier blocks' activations are still alive); planner and tracker order them alike."""
    training = TrainConfig(seq_len=256, global_batch_size=4, optimizer_impl="fused")
    early = Knobs(micro_batch_size=4, precision="fp32", checkpoint_blocks=(0,))
    late = Knobs(micro_batch_size=4, precision="fp32", checkpoint_blocks=(3,))
    p_early, m_early = _compare(SMALL, training, early)
    p_late, m_late = _compare(SMALL, training, late)
    assert m_early < m_late
    assert p_early < p_late
    assert p_late - p_early == pytest.approx(m_late - m_early, rel=0.05)


SEVEN_B_CASES = [
    # (precision, optimizer impl, checkpointed blocks, micro-batch, accumulation, blocks kept): the whole
    # 32-block model once; the other cases keep Llama 2 7B's first 8 blocks at full width (the same
    # block shapes, embedding and head; a quarter of the CPU)
    ("fp32", "foreach", (), 1, 1, 32),
    ("fp32", "fused", (0, 1), 1, 2, 8),
    ("bf16-true", "foreach", tuple(range(8)), 2, 1, 8),
    ("bf16-true", "fused", (6, 7), 1, 2, 8),
]


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "impl", "blocks", "micro", "accum", "n_layers"), SEVEN_B_CASES)
def test_llama2_7b_peak_matches_tracker(precision: str, impl: str, blocks: tuple[int, ...], micro: int, accum: int,
                                        n_layers: int) -> None:
    model, training = resolve("llama2-7b", seq_len=1024, global_batch_size=micro * accum)
    model = model.model_copy(update={"n_layers": n_layers})
    training = TrainConfig.model_validate({**training.model_dump(), "optimizer_impl": impl})
    knobs = Knobs(micro_batch_size=micro, grad_accum_steps=accum, precision=precision, checkpoint_blocks=blocks)
    predicted, measured = _compare(model, training, knobs)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.slow
def test_reference_figures_7b_fp32_adamw() -> None:
    """docs/references.md "Bytes per parameter": a 7B Llama in fp32 peaks at 125.8 GiB with AdamW foreach vs 100.7 GiB fused
    (params + grads + 2 moments, + one param-sized temporary for foreach). Our workload (one
    1024-token sequence) differs from the unstated one behind those figures, so allow 1%."""
    model, training = resolve("llama2-7b", seq_len=1024, global_batch_size=1)
    gib = 2**30
    for impl, reference in (("foreach", 125.8), ("fused", 100.7)):
        train = TrainConfig.model_validate({**training.model_dump(), "optimizer_impl": impl})
        peak = estimate(model, train, HW, Knobs(micro_batch_size=1, precision="fp32")).memory.peak_allocated_bytes
        assert peak / gib == pytest.approx(reference, rel=0.01)


@pytest.mark.parametrize(("optimizer", "impl"), [("sgd-momentum", "foreach"), ("sgd", "fused")])
def test_sgd_peak_matches_tracker(optimizer: str, impl: str) -> None:
    """SGD with momentum keeps one buffer per parameter; plain SGD none; neither allocates
    step temporaries without weight decay."""
    training = TrainConfig(seq_len=256, global_batch_size=8, optimizer=optimizer, optimizer_impl=impl)
    knobs = Knobs(micro_batch_size=4, grad_accum_steps=2, precision="fp32", checkpoint_blocks=(1,))
    predicted, measured = _compare(SMALL, training, knobs)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.parametrize(("precision", "segments"), [("fp32", ((0, 1), (2, 3))), ("bf16-mixed", ((0, 3),)),
                                                    ("bf16-mixed", ((1, 2),))])
def test_segment_checkpointing_matches_tracker(precision: str, segments: tuple[tuple[int, int], ...]) -> None:
    """Chen et al.'s segments: one torch.utils.checkpoint around several blocks."""
    training = TrainConfig(seq_len=256, global_batch_size=8, optimizer_impl="fused")
    knobs = Knobs(micro_batch_size=4, grad_accum_steps=2, precision=precision, checkpoint_segments=segments)
    predicted, measured = _compare(SMALL, training, knobs)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


def test_searched_plan_matches_tracker() -> None:
    """What the search chooses under a tight cap is what PyTorch allocates."""
    from roofplan import api

    training = TrainConfig(seq_len=256, global_batch_size=8, optimizer_impl="fused")
    loose = estimate(SMALL, training, HW, Knobs(micro_batch_size=8, precision="bf16-mixed"))
    cap = int(loose.memory.device_bytes * 0.97)
    plan = api.plan(SMALL, training, HW, cap, precisions=["bf16-mixed"])
    assert plan.best.knobs.checkpointed or plan.best.knobs.micro_batch_size < 8
    measured = simulate_step(SMALL, training, plan.best.knobs, flops=False).peak_allocated_bytes
    assert plan.best.estimate.memory.peak_allocated_bytes == pytest.approx(measured, rel=TOLERANCE)
