"""Simulate measures a steady-state step with at most three micro-batches (the first, one middle,
the last) and gets the same peak and FLOPs as the whole step: a 1,024-micro-batch plan of a 7B
model used to run 3 x 1,024 fake micro-batches (half an hour); now it runs a handful."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from planner.model.config import ModelConfig, TrainConfig  # noqa: E402
from planner.plan.knobs import GradSync, Knobs  # noqa: E402
from roofplan import api  # noqa: E402
from validate import simulate as simulate_module  # noqa: E402
from validate.api import validate  # noqa: E402
from validate.reference_model import Transformer  # noqa: E402
from validate.report import Verdict  # noqa: E402
from validate.simulate import MEASURED_MICRO_BATCHES, scaled_flops, steady_state_knobs  # noqa: E402

MODEL = ModelConfig(family="llama", name="micro-llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176,
                    vocab_size=512, max_seq_len=128)
SEQ = 64


def _plan(accum: int, gpus: int = 1, stage: int = 0, precision: str = "fp32", blocks: tuple[int, ...] = (),
          sync: GradSync = GradSync.EVERY):  # noqa: ANN202
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accum, precision=precision, data_parallel=gpus,
                  zero_stage=stage, checkpoint_blocks=blocks, fsdp_grad_sync=sync)
    return api.estimate_plan(MODEL, TrainConfig(seq_len=SEQ, global_batch_size=2 * accum * gpus), "h100-sxm", knobs)


def test_steady_state_knobs_keep_first_middle_last() -> None:
    for accum, measured in ((1, 1), (2, 2), (3, 3), (4, 3), (1024, 3)):
        knobs = Knobs(micro_batch_size=4, grad_accum_steps=accum)
        short = steady_state_knobs(knobs)
        assert short.grad_accum_steps == measured
        assert short.model_copy(update={"grad_accum_steps": accum}) == knobs  # nothing else changes
    assert MEASURED_MICRO_BATCHES == 3


def test_scaled_flops_is_exact_for_a_linear_count() -> None:
    """A f_mb + f_opt from the counts of 1 and 3 micro-batches, whatever f_opt is."""
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=1000)
    assert scaled_flops(lambda k: 7.0 * k.grad_accum_steps + 5.0, knobs) == 7005.0
    assert scaled_flops(lambda k: 7.0 * k.grad_accum_steps, knobs.model_copy(update={"grad_accum_steps": 1})) == 7.0


def _forward_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = Transformer.forward

    def counted(self: Transformer, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", counted)
    return calls


def test_a_long_accumulation_runs_a_handful_of_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: simulate ran every micro-batch three times (warm-up, measured, FLOPs)."""
    calls = _forward_calls(monkeypatch)
    stages: list[str] = []
    report = validate(_plan(accum=64), mode="simulate", progress=stages.append)
    assert report.verdict is Verdict.PASS, report.notes
    # warm-up 3 + measured 3 + FLOPs (1 + 3): not 3 x 64
    assert len(calls) == 10
    assert any("3 of its 64 micro-batches" in note for note in report.notes)
    assert any("3 of 64 micro-batches" in stage for stage in stages)
    assert stages[0].startswith("building") and stages[-1] == "counting FLOPs"


def _full_and_short(monkeypatch: pytest.MonkeyPatch, plan: object) -> tuple[object, object]:
    short = validate(plan, mode="simulate")  # type: ignore[arg-type]
    monkeypatch.setattr(simulate_module, "MEASURED_MICRO_BATCHES", 10**6)  # every micro-batch
    full = validate(plan, mode="simulate")  # type: ignore[arg-type]
    return short, full


# bf16-mixed is measured short and whole in test_peak_or_flops_alone_measure_what_both_do's plan too
@pytest.mark.parametrize(("precision", "blocks"), [("fp32", ()), ("bf16-true", (0, 1))])
def test_short_step_measures_what_the_whole_step_does(monkeypatch: pytest.MonkeyPatch, precision: str,
                                                      blocks: tuple[int, ...]) -> None:
    short, full = _full_and_short(monkeypatch, _plan(accum=5, precision=precision, blocks=blocks))
    assert short.measured.peak_allocated_bytes == full.measured.peak_allocated_bytes  # type: ignore[attr-defined]
    assert short.measured.model_flops_per_step == full.measured.model_flops_per_step  # type: ignore[attr-defined]
    assert short.verdict is Verdict.PASS


@pytest.mark.parametrize(("stage", "sync"), [(1, GradSync.EVERY), (3, GradSync.EVERY), (2, GradSync.LAST)])
def test_short_step_on_several_gpus(monkeypatch: pytest.MonkeyPatch, stage: int, sync: GradSync) -> None:
    """ZeRO-1 (emulated, DDP's resident gradients beside its sharded state) and FSDP2 on a fake
    process group, both gradient-sync modes."""
    short, full = _full_and_short(monkeypatch, _plan(accum=5, gpus=4, stage=stage, sync=sync))
    assert short.measured.peak_allocated_bytes == full.measured.peak_allocated_bytes  # type: ignore[attr-defined]
    assert short.verdict is Verdict.PASS
    assert any("3 of its 5 micro-batches" in note for note in short.notes)  # type: ignore[attr-defined]


def test_peak_or_flops_alone_measure_what_both_do() -> None:
    """``simulate_step(peak=False)`` / ``(flops=False)`` skip only the steps the other figure needs."""
    from validate.simulate import simulate_step

    knobs = Knobs(micro_batch_size=2, grad_accum_steps=4, precision="bf16-mixed", checkpoint_blocks=(1,))
    training = TrainConfig(seq_len=SEQ, global_batch_size=8)
    both = simulate_step(MODEL, training, knobs)
    peak_only = simulate_step(MODEL, training, knobs, flops=False)
    flops_only = simulate_step(MODEL, training, knobs, peak=False)
    assert peak_only.peak_allocated_bytes == both.peak_allocated_bytes and peak_only.flops_per_step is None
    assert flops_only.flops_per_step == both.flops_per_step and flops_only.peak_allocated_bytes is None
