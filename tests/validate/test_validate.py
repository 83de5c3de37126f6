"""validate: measured vs predicted through every mode, the tracker against torch's MemTracker,
the out-of-memory path, the CLI and `hardware calibrate`."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hardware.profile import HardwareProfile  # noqa: E402
from hardware.registry import load_hardware  # noqa: E402
from planner.model.config import ModelConfig, TrainConfig  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.precision import precision_spec  # noqa: E402
from planner.program.estimate import cached_graph, estimate  # noqa: E402
from planner.program.results import PlanResult  # noqa: E402
from roofplan import api  # noqa: E402
from roofplan.validate_cli import main as validate_main  # noqa: E402
from validate import calibrate as calibrate_module  # noqa: E402
from validate import run as run_module  # noqa: E402
from validate.api import validate  # noqa: E402
from validate.report import Verdict  # noqa: E402

SMALL = ModelConfig(family="llama", name="small-llama", n_layers=4, d_model=256, n_heads=8, n_kv_heads=4,
                    d_ff=688, vocab_size=2048, max_seq_len=512)


def _plan(model: ModelConfig, training: TrainConfig, knobs: Knobs, hardware: str = "h100-sxm") -> PlanResult:
    return api.estimate_plan(model, training, hardware, knobs)


# Each precision with each placement; the accumulation alternates between them, so each precision
# and each placement runs with 1 and with 3 micro-batches (pairwise: 6 cases where the full
# 2 x 3 x 2 product took 12, twice the CPU for no pair it did not already cover).
SIMULATE_SMALL_CASES = [pytest.param(precision, blocks, (1, 3)[(i + j) % 2], id=f"{precision}-{name}-{(1, 3)[(i + j) % 2]}")
                        for i, precision in enumerate(["fp32", "bf16-true"])
                        for j, (name, blocks) in enumerate([("none", ()), ("some", (1, 2)), ("all", (0, 1, 2, 3))])]


@pytest.mark.parametrize(("precision", "blocks", "accum"), SIMULATE_SMALL_CASES)
def test_simulate_small(precision: str, blocks: tuple[int, ...], accum: int) -> None:
    training = TrainConfig(seq_len=256, global_batch_size=2 * accum)
    report = validate(_plan(SMALL, training, Knobs(micro_batch_size=2, grad_accum_steps=accum, precision=precision,
                                                    checkpoint_blocks=blocks)), mode="simulate")
    assert report.verdict is Verdict.PASS, report.notes
    assert abs(report.errors["peak_allocated"]) < 0.03
    assert abs(report.errors["model_flops"]) < 0.005


@pytest.mark.parametrize("attention", ["flash", "eager"])
@pytest.mark.parametrize(("gpus", "stage", "precision"), [(1, 0, "fp32"), (1, 0, "bf16-mixed"), (4, 1, "fp32"),
                                                          (4, 3, "bf16-mixed")])
def test_simulate_with_dropout(attention: str, gpus: int, stage: int, precision: str) -> None:
    """Regression: with dropout, the CPU's SDPA falls back to the math kernel and saves the T x T
    probabilities, which a GPU's flash kernel does not: simulate failed flash plans by +40%. The
    simulated fused attention now runs without dropout (the other dropouts stay), and says so."""
    model = ModelConfig.model_validate({**SMALL.model_dump(), "n_layers": 2, "dropout": 0.1, "attention": attention})
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=2, precision=precision, data_parallel=gpus, zero_stage=stage,
                  checkpoint_blocks=(0,) if gpus == 1 else ())
    training = TrainConfig(seq_len=256, global_batch_size=2 * gpus)
    report = validate(api.estimate_plan(model, training, "h100-sxm", knobs), mode="simulate")
    assert report.verdict is Verdict.PASS, report.notes
    assert abs(report.errors["peak_allocated"]) < 0.03
    assert any("attention dropout is left out" in note for note in report.notes) == (attention == "flash")


def test_run_on_cpu_with_dropout_says_why_memory_reads_high(placeholder_cpu_profile: HardwareProfile) -> None:
    """A real CPU step cannot run flash attention with dropout: the math kernel keeps T x T
    probabilities the plan (for a GPU) does not count. The report fails on memory and says why."""
    model = ModelConfig.model_validate({**SMALL.model_dump(), "n_layers": 2, "dropout": 0.1})
    plan = api.estimate_plan(model, TrainConfig(seq_len=256, global_batch_size=2), "h100-sxm",
                             Knobs(micro_batch_size=2, grad_accum_steps=1, precision="fp32"))
    report = validate(plan, mode="run", device="cpu", steps=1)
    assert report.errors["peak_allocated"] > 0.10
    assert any("math kernel here" in note and "--mode simulate" in note for note in report.notes)


def test_as_on_a_gpu_keeps_the_other_dropouts() -> None:
    from validate.reference_model import AttentionCore, Dropout, build_model
    from validate.simulate import as_on_a_gpu

    net = build_model(SMALL.model_copy(update={"dropout": 0.1}))
    assert as_on_a_gpu(net)
    assert all(m.dropout == 0.0 for m in net.modules() if isinstance(m, AttentionCore))
    others = [m for m in net.modules() if isinstance(m, Dropout)]
    assert others and all(m.p == 0.1 for m in others)
    assert not as_on_a_gpu(net)  # nothing left to change
    assert not as_on_a_gpu(build_model(ModelConfig.model_validate({**SMALL.model_dump(), "dropout": 0.1,
                                                                   "attention": "eager"})))


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "blocks"), [("bf16-true", (0, 4))])
def test_simulate_7b(precision: str, blocks: tuple[int, ...]) -> None:
    """A 7B-wide plan through validate's simulate mode (peak within 3%, FLOPs, verdict): Llama 2
    7B's blocks at full width (d_model 4096, 32 heads, its vocabulary), 8 of its 32 (fake tensors
    cost per op, not per byte: every block adds the same work, and the whole 7B model cost 19 s of
    the suite), every fourth block checkpointed. Its two sequences run as one micro-batch. The
    whole 7B model's peak is checked against the tracker in tests/planner/test_memory_vs_tracker.py
    (fp32 and bf16-true, none, some and every block, two cases accumulating 2 micro-batches), and
    other precisions through validate here in test_simulate_small."""
    model, training = api.load_model("llama2-7b", seq_len=1024, global_batch_size=2)
    model = model.model_copy(update={"n_layers": 8})
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=1, precision=precision, checkpoint_blocks=blocks)
    report = validate(_plan(model, training, knobs, "h200"), mode="simulate")
    assert report.passed, report.notes
    assert abs(report.errors["peak_allocated"]) < 0.03


def _spy_on_calibration(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object, HardwareProfile]]:
    """Record every in-process CPU calibration ``run`` makes (device, workload, profile); the real
    calibration still runs."""
    real = calibrate_module.calibrate
    calls: list[tuple[str, object, HardwareProfile]] = []

    def spy(device: str = "cpu", *args: object, **kwargs: object) -> HardwareProfile:
        profile = real(device, *args, **kwargs)  # type: ignore[arg-type]
        calls.append((device, kwargs.get("workload"), profile))
        return profile

    monkeypatch.setattr(calibrate_module, "calibrate", spy)
    return calls


@pytest.fixture
def placeholder_cpu_profile(monkeypatch: pytest.MonkeyPatch) -> HardwareProfile:
    """The bundled ``cpu`` profile in place of ``run``'s in-process calibration (2-3 s a run) for
    tests that do not judge time; test_run_on_cpu_real_step calibrates for real."""
    profile = load_hardware("cpu")
    monkeypatch.setattr(calibrate_module, "calibrate", lambda device="cpu", *args, **kwargs: profile)
    return profile


REAL_STEP_MODEL = SMALL.model_copy(update={"n_layers": 2})
REAL_STEP_TRAINING = TrainConfig(seq_len=256, global_batch_size=8)
REAL_STEP_KNOBS = Knobs(micro_batch_size=4, grad_accum_steps=2, precision="fp32")


def test_run_on_cpu_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model's real step: bytes from the tracker within 3% and FLOPs within 0.5% (both
    deterministic); the step time measured (positive, tokens/s derived from it) and predicted
    with the CPU profile calibrated in the same process on the plan's own kernels: exactly what
    ``estimate`` gives with that profile, judged against the 40% CPU tolerance.

    Whether the measured time lands within 40% is not asserted: that is a wall-clock comparison
    on a shared machine (the in-process calibration of this model's kernels alone varied 80-110
    GFLOP/s from one run to the next; fifteen runs on an idle 2-core machine erred from -11% to
    +45%, two of them past 40%, so this test used to retry up to three times and still failed
    now and then). ``python benchmarks/cpu_step_time.py`` measures that figure; the judgement of
    time is checked on a mocked clock in test_run_on_cpu_judges_time_on_a_mocked_clock."""
    calls = _spy_on_calibration(monkeypatch)
    plan = _plan(REAL_STEP_MODEL, REAL_STEP_TRAINING, REAL_STEP_KNOBS)
    report = validate(plan, mode="run", device="cpu", steps=2)
    assert report.fits and not report.out_of_memory
    assert abs(report.errors["peak_allocated"]) < 0.03
    assert abs(report.errors["model_flops"]) < 0.005
    [(device, workload, profile)] = calls  # calibrated once, on the CPU, on the plan's graph
    assert device == "cpu"
    assert workload is cached_graph(REAL_STEP_MODEL, 4, 256, precision_spec("fp32"))
    expected = estimate(REAL_STEP_MODEL, REAL_STEP_TRAINING, profile, REAL_STEP_KNOBS, plan.hbm_cap_bytes)
    assert expected.step_time_s != plan.best.estimate.step_time_s  # the CPU profile's, not the H100 plan's
    assert report.predicted.step_time_s == expected.step_time_s
    assert report.predicted.tokens_per_s == expected.tokens_per_s
    measured = report.measured.step_time_s
    assert measured is not None and measured > 0 and math.isfinite(measured)
    assert report.measured.tokens_per_s == pytest.approx(REAL_STEP_TRAINING.tokens_per_step / measured)
    assert report.errors["step_time"] == pytest.approx(measured / expected.step_time_s - 1)
    assert report.tolerances["step_time"] == 0.40
    # bytes and FLOPs pass, so the verdict is the time's
    assert report.passed == (abs(report.errors["step_time"]) <= 0.40), report.notes
    assert any("calibrated in this process on the plan's kernels" in note for note in report.notes)


@pytest.mark.parametrize(("slowdown", "verdict"), [(1.25, Verdict.PASS), (0.7, Verdict.PASS), (1.5, Verdict.FAIL),
                                                   (0.5, Verdict.FAIL)])
def test_run_on_cpu_judges_time_on_a_mocked_clock(monkeypatch: pytest.MonkeyPatch, slowdown: float,
                                                  verdict: Verdict, placeholder_cpu_profile: HardwareProfile) -> None:
    """The time judgement of a real CPU run with a clock that cannot flake: every timed step
    takes exactly ``slowdown`` x the predicted time on a mocked ``time.perf_counter`` (one tick
    per call; nothing in the step reads the clock), against the fixed placeholder CPU profile.
    Within 40% passes; beyond, the report fails and says by how much. (A one-block model: the
    clock, not the step, is under test.)"""
    import time

    model = SMALL.model_copy(update={"n_layers": 1})
    training = TrainConfig(seq_len=64, global_batch_size=2)
    knobs = Knobs(micro_batch_size=2, precision="fp32")
    plan = _plan(model, training, knobs)
    predicted = estimate(model, training, placeholder_cpu_profile, knobs, plan.hbm_cap_bytes).step_time_s
    ticks = itertools.count()
    with monkeypatch.context() as clock:
        clock.setattr(time, "perf_counter", lambda: next(ticks) * predicted * slowdown)
        report = validate(plan, mode="run", device="cpu", steps=3)
    assert report.fits
    assert report.predicted.step_time_s == predicted
    assert report.measured.step_time_s == pytest.approx(predicted * slowdown, rel=1e-9)
    assert report.measured.tokens_per_s == pytest.approx(training.tokens_per_step / (predicted * slowdown), rel=1e-9)
    assert report.errors["step_time"] == pytest.approx(slowdown - 1, abs=1e-9)
    assert report.verdict is verdict, report.notes
    reasons = [note for note in report.notes if "off by" in note]
    assert reasons == ([] if verdict is Verdict.PASS else [f"step_time off by {slowdown - 1:+.1%} (tolerance ±40%)"])


def test_tracker_equals_memtracker() -> None:
    """Our live-storage tracker (unrounded) vs torch.distributed._tools.mem_tracker.MemTracker on
    a real CPU training step: the same peak, to the byte."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from planner.precision import precision_spec
    from validate.apply import configure_model, make_optimizer, train_step
    from validate.reference_model import build_model
    from validate.tracker import LiveStorageTracker

    model, training = api.load_model("tiny-llama")
    for blocks in ((), (0,)):
        knobs = Knobs(micro_batch_size=8, precision="fp32", checkpoint_blocks=blocks)
        torch.manual_seed(0)
        net = configure_model(build_model(model), knobs)
        optimizer = make_optimizer(net, training)
        ids = torch.randint(0, model.vocab_size, (8, 128))
        train_step(net, optimizer, ids, ids, knobs, precision_spec("fp32"))
        reference = MemTracker()
        reference.track_external(net, optimizer)
        with reference:
            train_step(net, optimizer, ids, ids, knobs, precision_spec("fp32"))
        expected = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        ours = LiveStorageTracker(block_bytes=1)
        ours.track([*net.parameters(), ids, *state])
        with ours:
            ours.reset_peak()
            train_step(net, optimizer, ids, ids, knobs, precision_spec("fp32"))
        assert ours.peak_bytes == expected


def test_out_of_memory_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             placeholder_cpu_profile: HardwareProfile) -> None:
    def oom(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(run_module, "_measure", oom)
    model, training = api.load_model("tiny-llama")
    plan = _plan(model, training, Knobs(micro_batch_size=8, precision="fp32"))
    report = validate(plan, mode="run", device="cpu", steps=2)
    assert not report.fits and report.out_of_memory
    assert report.verdict is Verdict.FAIL
    assert any("does not fit" in note for note in report.notes)
    path = plan.save(tmp_path / "plan.json")
    assert validate_main([str(path), "--mode", "run", "--device", "cpu", "--json"]) == 1


@pytest.mark.gpu
def test_run_on_cuda() -> None:
    model, training = api.load_model("tiny-llama", global_batch_size=16)
    report = validate(api.plan(model, training, "h100-sxm"), mode="run", device="cuda", steps=5)
    assert report.fits
    assert abs(report.errors["peak_allocated"]) < 0.05


def test_cli_json_schema_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, training = api.load_model("tiny-gpt2")
    path = _plan(model, training, Knobs(micro_batch_size=4, grad_accum_steps=2, precision="bf16-true")).save(
        tmp_path / "plan.json")
    assert validate_main([str(path), "--mode", "simulate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "pass"
    for side in ("predicted", "measured"):
        assert {"peak_allocated_bytes", "step_time_s", "tokens_per_s", "model_flops_per_step"} <= set(data[side])
    assert set(data["errors"]) == {"peak_allocated", "model_flops"}
    assert data["measured"]["step_time_s"] is None  # simulate measures no time
    assert validate_main([str(path), "--mode", "simulate"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["missing.json"], "missing.json"),
        (["{plan}", "--steps", "0", "--mode", "run", "--device", "cpu"], "--steps"),
        (["{plan}", "--mode", "simulate", "--device", "cuda"], "--device"),
        (["{bad}"], "plan file"),
        (["{plan}", "--mode", "warp"], "--mode"),
    ],
)
def test_cli_bad_input(argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, training = api.load_model("tiny-llama")
    plan = _plan(model, training, Knobs(micro_batch_size=8, precision="fp32")).save(tmp_path / "plan.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 3}')
    args = [a.format(plan=plan, bad=bad) for a in argv]
    assert _exit_code(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


def _exit_code(argv: list[str]) -> int:
    """validate's exit code, whether main returns it or argparse exits with it."""
    try:
        return validate_main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


def test_hardware_calibrate_writes_a_profile_plan_accepts(tmp_path: Path) -> None:
    from roofplan.hardware_cli import main as hardware_main

    out = tmp_path / "cpu.yaml"
    assert hardware_main(["calibrate", "--device", "cpu", "--out", str(out)]) == 0
    from hardware.registry import load_hardware

    profile = load_hardware(out)
    assert profile.peak_flops_per_s and profile.kernel_launch_s > 0 and profile.hbm_bandwidth_bytes_per_s > 1e8
    model, training = api.load_model("tiny-llama")
    result = api.plan(model, training, out)
    assert result.best.estimate.memory.fits


def test_plan_then_validate_in_one_go(capsys: pytest.CaptureFixture[str]) -> None:
    from roofplan.cli import main as plan_main

    code = plan_main(["--model", "tiny-llama", "--micro-batch", "8", "--precision", "fp32", "--checkpoint", "0",
                      "--validate", "--validate-mode", "simulate", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["validation"]["verdict"] == "pass"
    assert data["validation"]["mode"] == "simulate"
