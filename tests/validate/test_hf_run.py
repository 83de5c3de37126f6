"""``validate --implementation hf --mode run``: transformers' own model for real steps
(``validate.hf_model._run_hf``), here on the CPU with a small Llama from the fixtures.

On the CPU the step runs as a GPU would (``as_a_gpu_runs_it``); its bytes come from the
live-storage tracker over a real step and its FLOPs from FlopCounterMode, compared with the plan
priced again for transformers' code and, with no profile given, for this CPU (calibrated in the
process: replaced here by the bundled ``cpu`` profile, which a spy records; the time is not
judged). Measured when written: peak within 0.03% (fp32) and 0.07% (bf16-mixed, every layer
checkpointed, two micro-batches), FLOPs equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hardware.errors import ConfigError  # noqa: E402
from hardware.profile import HardwareProfile  # noqa: E402
from hardware.registry import load_hardware  # noqa: E402
from planner.model.config import ModelConfig, TrainConfig  # noqa: E402
from planner.model.sources import model_from_hf_config  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.precision import precision_spec  # noqa: E402
from planner.program.estimate import cached_graph, estimate  # noqa: E402
from planner.program.results import PlanResult  # noqa: E402
from roofplan import api  # noqa: E402
from validate import calibrate as calibrate_module  # noqa: E402
from validate import hf_model  # noqa: E402
from validate.api import validate  # noqa: E402
from validate.report import Mode, Verdict  # noqa: E402

FIXTURE = Path(__file__).parent.parent / "fixtures" / "hf" / "llama.json"
SEQ = 128


def llama(implementation: str = "reference") -> ModelConfig:
    model = model_from_hf_config(json.loads(FIXTURE.read_text()), name="llama")
    return ModelConfig.model_validate({**model.model_dump(), "max_seq_len": SEQ, "implementation": implementation})


def reference_plan(knobs: Knobs) -> PlanResult:
    """A plan of the reference model, as ``roofplan plan`` writes it: validate re-prices it for hf."""
    training = TrainConfig(seq_len=SEQ, global_batch_size=knobs.micro_batch_size * knobs.grad_accum_steps)
    return api.estimate_plan(llama(), training, "h100-sxm", knobs)


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, HardwareProfile]]:
    """``calibrate`` replaced by the bundled cpu profile; each call recorded (device, workload)."""
    profile = load_hardware("cpu")
    calls: list[tuple[str, Any, HardwareProfile]] = []

    def spy(device: str = "cpu", *args: Any, **kwargs: Any) -> HardwareProfile:
        calls.append((device, kwargs.get("workload"), profile))
        return profile

    monkeypatch.setattr(calibrate_module, "calibrate", spy)
    return calls


@pytest.mark.parametrize(("precision", "checkpoint", "accumulation"), [("fp32", False, 1), ("bf16-mixed", True, 2)])
def test_run_hf_on_cpu_measures_transformers_step(calibrations: list[tuple[str, Any, HardwareProfile]],
                                                  monkeypatch: pytest.MonkeyPatch, precision: str, checkpoint: bool,
                                                  accumulation: int) -> None:
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accumulation, precision=precision,
                  checkpoint_blocks=(0, 1) if checkpoint else ())
    plan = reference_plan(knobs)
    timed: list[int] = []
    real_measure = hf_model.measure_steps

    def measure(step: Any, dev: Any, steps: int, resident: Any) -> Any:
        timed.append(steps)
        return real_measure(step, dev, steps, resident)

    monkeypatch.setattr(hf_model, "measure_steps", measure)
    report = validate(plan, mode="run", device="cpu", steps=2, implementation="hf")
    assert timed == [2]

    # priced for transformers' code with the profile calibrated on the hf plan's own kernels
    [(device, workload, profile)] = calibrations
    hf = llama("hf")
    assert device == "cpu" and workload is cached_graph(hf, 2, SEQ, precision_spec(precision))
    expected = estimate(hf, plan.training, profile, knobs, plan.hbm_cap_bytes)
    assert expected.memory.peak_allocated_bytes != plan.best.estimate.memory.peak_allocated_bytes  # not the reference's
    assert report.predicted.peak_allocated_bytes == expected.memory.peak_allocated_bytes
    assert report.predicted.step_time_s == expected.step_time_s
    assert report.predicted.tokens_per_s == expected.tokens_per_s
    assert report.predicted.model_flops_per_step == expected.hardware_flops_per_step

    # a real run of two timed steps, measured on this CPU
    assert report.mode is Mode.RUN and report.steps == 2
    assert report.device == f"cpu ({torch.get_num_threads()} threads)"
    assert report.fits and not report.out_of_memory and report.allocated_at_failure_bytes is None
    assert report.measured.reserved_bytes is None  # no caching allocator on the CPU
    assert abs(report.errors["peak_allocated"]) < 0.01
    assert report.measured.model_flops_per_step == pytest.approx(expected.hardware_flops_per_step, rel=0.005)
    measured_time = report.measured.step_time_s
    assert measured_time is not None and measured_time > 0
    assert report.measured.tokens_per_s == pytest.approx(plan.training.tokens_per_step / measured_time)
    assert report.tolerances["step_time"] == 0.40  # the CPU run's tolerances

    assert report.notes[0].startswith("implementation hf: transformers")
    assert any("calibrated in this process" in note for note in report.notes)
    assert any("bool masks" in note for note in report.notes)  # as_a_gpu_runs_it's, on the CPU
    assert any("fp32 lists" in note for note in report.notes) == (precision == "bf16-mixed")


def test_run_hf_reports_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that runs out of memory is a report (fits: false), not an exception."""
    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(hf_model, "measure_steps", out_of_memory)
    knobs = Knobs(micro_batch_size=2, precision="fp32")
    report = validate(reference_plan(knobs), mode="run", device="cpu", steps=1, hardware="cpu", implementation="hf")
    assert report.mode is Mode.RUN and report.steps == 0
    assert report.out_of_memory and not report.fits and report.verdict is Verdict.FAIL
    assert report.allocated_at_failure_bytes is None  # the CPU has no allocator to read
    assert report.measured.peak_allocated_bytes is None and report.measured.step_time_s is None
    hf = llama("hf")
    expected = estimate(hf, TrainConfig(seq_len=SEQ, global_batch_size=2), load_hardware("cpu"), knobs)
    assert report.predicted.peak_allocated_bytes == expected.memory.peak_allocated_bytes
    assert report.predicted.step_time_s == expected.step_time_s  # the given profile: no calibration


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_run_hf_refuses_cuda_without_a_device() -> None:
    with pytest.raises(ConfigError, match="--device") as error:
        validate(reference_plan(Knobs(micro_batch_size=2, precision="fp32")), mode="run", device="cuda",
                 implementation="hf")
    assert "\n" not in str(error.value) and "--device cpu" in str(error.value)
