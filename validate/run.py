"""Run a plan in PyTorch and compare what it does with what was predicted.

Three ways to measure, one ``ValidationReport``:

- ``simulate``: the reference model under fake tensors on the CPU, the live-storage tracker for
  bytes and FlopCounterMode for FLOPs: any model size, no GPU, no time;
- ``run`` on ``cpu``: real steps of a small model; bytes from the tracker, time as the median of
  timed steps after warm-up, compared with a CPU profile calibrated in the same process on the
  plan's own kernels (``validate.calibrate``);
- ``run`` on ``cuda``: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  CUDA-event timing after warm-up, median over steps. Running out of memory is caught and
  reported as "does not fit" with what was allocated, never a crash.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hardware.errors import ConfigError
from hardware.profile import HardwareProfile
from planner.precision import precision_spec
from planner.program.estimate import Estimate, cached_graph, estimate
from planner.program.results import PlanResult
from validate.apply import configure_model, make_optimizer, make_scaler, optimizer_state, param_dtype, train_step
from validate.flops import flop_counter
from validate.reference_model import build_model
from validate.report import TOLERANCES, Figures, Mode, RankComparison, ValidationReport, judge
from validate.simulate import (
    Progress,
    flash_with_dropout,
    shortened_step_note,
    simulate_step,
    simulated_dropout_note,
)
from validate.tracker import LiveStorageTracker

if TYPE_CHECKING:
    from validate.memory_record import MemoryRecorder

WARMUP_STEPS = 2  # the first step creates the optimizer state; the second is the steady state


def _predicted(est: Estimate) -> Figures:
    """The planner's figures; FLOPs as FlopCounterMode counts a step: recomputation included."""
    return Figures(
        peak_allocated_bytes=est.memory.peak_allocated_bytes,
        step_time_s=est.step_time_s,
        tokens_per_s=est.tokens_per_s,
        model_flops_per_step=est.hardware_flops_per_step,
    )


def build_report(plan: PlanResult, mode: Mode, device: str, steps: int, predicted: Figures, measured: Figures,
                 fits: bool, notes: tuple[str, ...] = (), oom: bool = False, allocated: int | None = None,
                 tolerances: dict[str, float] | None = None, per_rank: tuple[Figures, ...] = (),
                 pipeline_ranks: tuple[RankComparison, ...] = ()) -> ValidationReport:
    """The report of one validation; ``tolerances`` default to the mode's and device's."""
    if tolerances is None:
        tolerances = TOLERANCES[(mode, "cuda" if device.startswith("cuda") else "cpu")]
    errors, verdict, reasons = judge(predicted, measured, tolerances, fits, pipeline_ranks)
    return ValidationReport(
        model=plan.model.name,
        hardware=plan.hardware.name,
        knobs=plan.best.knobs.model_dump(mode="json"),
        mode=mode,
        device=device,
        torch_version=torch.__version__,
        steps=steps,
        predicted=predicted,
        measured=measured,
        errors=errors,
        tolerances=tolerances,
        fits=fits,
        out_of_memory=oom,
        allocated_at_failure_bytes=allocated,
        notes=notes + reasons,
        verdict=verdict,
        per_rank=per_rank,
        pipeline_ranks=pipeline_ranks,
    )


def simulate(plan: PlanResult, progress: Progress | None = None,
             recorder: MemoryRecorder | None = None) -> ValidationReport:
    """Fake tensors: the plan's exact bytes and FLOPs in real PyTorch code, any size, no GPU;
    ``recorder`` records the measured step's allocations (``validate.memory_record``)."""
    model, training, knobs = plan.model.config, plan.training, plan.best.knobs
    step = simulate_step(model, training, knobs, progress=progress, recorder=recorder)
    measured = Figures(peak_allocated_bytes=step.peak_allocated_bytes, model_flops_per_step=step.flops_per_step)
    expected = _predicted(plan.best.estimate).model_copy(update={"step_time_s": None, "tokens_per_s": None})
    notes: tuple[str, ...] = ("simulate: fake tensors measure bytes and FLOPs exactly but take no time; FLOPs "
                              "compared as hardware FLOPs (recomputation included)",)
    notes += shortened_step_note(knobs) + simulated_dropout_note(model)
    return build_report(plan, Mode.SIMULATE, f"cpu (fake tensors, {os.cpu_count()} cores)", 1, expected, measured,
                   fits=True, notes=notes)


def run(plan: PlanResult, device: str = "cuda", steps: int = 5, calibrate_cpu: bool = True,
        profile: HardwareProfile | None = None, progress: Progress | None = None,
        recorder: MemoryRecorder | None = None) -> ValidationReport:
    """Real steps on ``device``; the prediction is re-made with a profile measured here when
    running on the CPU (or with ``profile`` if given). ``recorder`` records one more step's
    allocations and a ``torch.profiler`` trace of it (``_profile_step``)."""
    say = progress or (lambda _text: None)
    if steps <= 0:
        raise ConfigError(f"--steps: must be positive, got {steps}")
    model, training, knobs = plan.model.config, plan.training, plan.best.knobs
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device: cuda requested but torch sees no CUDA device; use --device cpu or --mode simulate")
    spec = precision_spec(knobs.precision)
    notes: tuple[str, ...] = ()
    if profile is None and dev.type == "cpu" and calibrate_cpu:
        from validate.calibrate import calibrate

        graph = cached_graph(model, knobs.micro_batch_size, training.seq_len, spec)
        say("calibrating the CPU on the plan's kernels")
        profile = calibrate("cpu", workload=graph)
        notes += (f"time predicted with a CPU profile calibrated in this process on the plan's kernels "
                  f"({profile.peak_flops_per_s[spec.matmul_precision] / 1e9:.0f} GFLOP/s, "
                  f"{profile.hbm_bandwidth_bytes_per_s / 1e9:.1f} GB/s, {profile.kernel_launch_s * 1e6:.1f} µs per kernel)",)
    est = estimate(model, training, profile, knobs, plan.hbm_cap_bytes) if profile is not None else plan.best.estimate
    if dev.type == "cpu":
        _check_host_memory(est)
        if flash_with_dropout(model):
            notes += ("the CPU's fused attention has no dropout: PyTorch runs its math kernel here, which keeps the "
                      "T x T probabilities that a GPU's flash kernel (and the plan) does not; --mode simulate "
                      "measures what a GPU keeps",)
    predicted = _predicted(est)
    label = f"cuda: {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    try:
        say(f"running {WARMUP_STEPS} warm-up and {steps} timed steps of {knobs.grad_accum_steps} micro-batches")
        measured = _measure(plan, dev, steps, recorder)
    except torch.OutOfMemoryError:
        allocated = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return build_report(plan, Mode.RUN, label, 0, predicted, Figures(), fits=False, oom=True, allocated=allocated,
                       notes=notes)
    return build_report(plan, Mode.RUN, label, steps, predicted, measured, fits=True, notes=notes)


def _check_host_memory(est: Estimate) -> None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if est.memory.peak_allocated_bytes > 0.5 * total:
        raise ConfigError(
            f"--mode run --device cpu: this plan needs about {est.memory.peak_allocated_bytes / 1e9:.1f} GB, more "
            f"than half of this machine's {total / 1e9:.1f} GB; use --mode simulate (any size) or a GPU"
        )


def _measure(plan: PlanResult, dev: torch.device, steps: int, recorder: MemoryRecorder | None = None) -> Figures:
    model, training, knobs = plan.model.config, plan.training, plan.best.knobs
    spec = precision_spec(knobs.precision)
    torch.manual_seed(0)
    with torch.device(dev):
        net = configure_model(build_model(model, param_dtype(spec)), knobs)
    optimizer = make_optimizer(net, training)
    scaler = make_scaler(spec, dev.type)
    rows = knobs.micro_batch_size * knobs.grad_accum_steps
    ids = torch.randint(0, model.vocab_size, (rows, training.seq_len), device=dev)
    targets = torch.randint(0, model.vocab_size, (rows, training.seq_len), device=dev)

    def step() -> None:
        train_step(net, optimizer, ids, targets, knobs, spec, scaler)

    if recorder is not None:
        recorder.attach(net, optimizer, [ids, targets])
    times, peak, reserved = measure_steps(
        step, dev, steps, lambda: [*net.parameters(), *net.buffers(), ids, targets, *optimizer_state(optimizer)],
        recorder)
    if recorder is not None:
        recorder.profiler_trace = _profile_step(step, dev)
    counter = flop_counter()
    with counter:
        step()
    median = statistics.median(times)
    return Figures(
        peak_allocated_bytes=int(peak),
        step_time_s=median,
        tokens_per_s=training.tokens_per_step / median,
        model_flops_per_step=float(counter.get_total_flops()),
        reserved_bytes=reserved,
    )


def measure_steps(step: Callable[[], None], dev: torch.device, steps: int,
                  resident: Callable[[], list[torch.Tensor]],
                  recorder: MemoryRecorder | None = None) -> tuple[list[float], int, int | None]:
    """Warm up, time ``steps`` steps and measure one step's peak: CUDA events and the caching
    allocator's peaks on a GPU; wall clock and the live-storage tracker on a CPU, which is told
    ``resident()`` (the tensors alive between steps, read after the warm-up). ``recorder``
    (attached to the step) records the tracked step on a CPU; on a GPU one more step runs under
    ``torch.cuda.memory._record_memory_history`` and ``recorder.device_snapshot`` is its
    ``_snapshot()``. Returns (step times, peak allocated bytes, peak reserved bytes or None)."""
    for _ in range(WARMUP_STEPS):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        times = _cuda_times(step, steps)
        peak, reserved = torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev)
        if recorder is not None:
            recorder.device_snapshot = _cuda_snapshot(step, dev)
        return times, peak, reserved
    times = _cpu_times(step, steps)
    tracker = recorder.tracker() if recorder is not None else LiveStorageTracker()
    tracker.track(resident())
    with tracker:
        tracker.reset_peak()
        if recorder is not None:
            recorder.begin()
        step()
        if recorder is not None:
            recorder.end()
    return times, tracker.peak_bytes, None


def _cuda_snapshot(step: Callable[[], None], dev: torch.device) -> dict:
    """One step under ``torch.cuda.memory._record_memory_history`` (torch 2.13,
    torch/cuda/memory.py): the caching allocator's own snapshot of it, Python stacks in the frames.
    Recording is switched off again whatever happens (untested here: written without a GPU)."""
    torch.cuda.synchronize(dev)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=dev)
    try:
        step()
        torch.cuda.synchronize(dev)
        return torch.cuda.memory._snapshot(dev)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=dev)


def _profile_step(step: Callable[[], None], dev: torch.device) -> dict:
    """One more step under ``torch.profiler`` (CPU, and CUDA kernels on a GPU), as the dict its
    ``export_chrome_trace`` writes: measured times, from this process's clock."""
    import json
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def _cpu_times(step: Callable[[], None], steps: int) -> list[float]:
    import time

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def _cuda_times(step: Callable[[], None], steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times
