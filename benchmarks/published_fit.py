"""Fit, on the fit half of llm-foundry's published MPT runs only (``published_runs.split_half``),
the llm-foundry stack's ``step_efficiency`` per GPU profile and the causal rate of the runs' Triton
attention kernel (``hardware/stacks/llm-foundry.yaml`` holds the results),
and report the test half with the fitted values (``python benchmarks/published_fit.py``). What the
runs are and how each is planned: ``benchmarks/published_runs.py``."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

from published_runs import (
    HARDWARE,
    MODELS_CSV,
    RUNS_CSV,
    TRITON_SOURCE,
    _bool,
    plan_row,
    print_summary,
    read_csv,
    split_half,
    summarize,
)

from hardware.kernels import AttentionCurve, AttentionKernel, Direction
from hardware.profile import HardwareProfile
from hardware.registry import load_hardware
from hardware.stack import Stack, on_stack


def _bisect(median_error: Callable[[float], float], low: float, high: float, rounds: int) -> float:
    """The value in [low, high] where ``median_error`` (growing with the value) crosses zero."""
    for _ in range(rounds):
        middle = (low + high) / 2
        if median_error(middle) > 0:
            high = middle
        else:
            low = middle
    return (low + high) / 2


def _median_error(rows: list[dict[str, str]], models: dict[str, dict[str, str]], profile: str,
                  hardware: HardwareProfile) -> float:
    errors = [r.error for r in (plan_row(row, models, {profile: hardware}) for row in rows) if r.error is not None]
    return statistics.median(errors)


def with_triton_rate(hardware: HardwareProfile, tflops: float) -> HardwareProfile:
    """``hardware`` with llm-foundry's Triton attention kernel at one causal rate (any head dim, any
    length: the runs' marginal rates are flat from 4k to 64k tokens and alike at head dims 64 and 128)."""
    kept = tuple(c for c in hardware.attention_curves if c.kernel is not AttentionKernel.FLASH_TRITON)
    fitted = AttentionCurve(kernel=AttentionKernel.FLASH_TRITON, direction=Direction.FWD_BWD, causal=True,
                            head_dim=128, seq_lens=(8192,), tflops=(round(tflops, 1),), source=TRITON_SOURCE)
    return hardware.model_copy(update={"attention_curves": (*kept, fitted)})


def fit_profile(rows: list[dict[str, str]], models: dict[str, dict[str, str]], profile: str,
                rounds: int = 12, sweeps: int = 5) -> tuple[HardwareProfile, float, float]:
    """Fit two numbers of ``profile`` on ``rows`` (its fit half), by alternating bisections: the
    Triton attention kernel's causal rate, so that the median error of the rows of at least 8k tokens
    is zero (the context where attention is most of the step), and ``step_efficiency``, so that the
    median error of all rows is zero. Returns the fitted profile and both medians."""
    hardware = on_stack(load_hardware(profile), Stack.LLM_FOUNDRY)  # the stack's fitted figures, to be fitted again
    long_rows = [r for r in rows if int(r["seq_len"]) >= 8192]
    rate = next((c.tflops[0] for c in hardware.attention_curves if c.kernel is AttentionKernel.FLASH_TRITON), 100.0)
    for _ in range(sweeps):
        hardware = with_triton_rate(hardware, rate)
        efficiency = round(_bisect(lambda v, hw=hardware: _median_error(
            rows, models, profile, hw.model_copy(update={"step_efficiency": v})), 0.3, 1.0, rounds), 3)
        hardware = hardware.model_copy(update={"step_efficiency": efficiency})
        if long_rows:
            rate = _bisect(lambda v, hw=hardware: _median_error(long_rows, models, profile, with_triton_rate(hw, v)),
                           20.0, 1000.0, rounds)
    hardware = with_triton_rate(hardware, rate)
    long_error = _median_error(long_rows, models, profile, hardware) if long_rows else float("nan")
    return hardware, _median_error(rows, models, profile, hardware), long_error


def marginal_attention_rates(rows: list[dict[str, str]], models: dict[str, dict[str, str]]) -> dict[str, list[float]]:
    """Model-free attention rates (TFLOP/s) per GPU read off the published rows alone: for two runs of
    one model on one GPU type and GPU count, same checkpointing, contexts T1 < T2 (both >= 4k), the
    extra seconds per token over the extra attention FLOPs per token. FlashAttention's convention:
    causal forward ``2 T D`` per token and layer, backward 2.5 x forward, checkpointing recomputes
    the forward once: ``(7 or 9) L T D``. Everything else that grows with T (the learned position
    table) is counted as attention, so these are lower bounds of the kernel's in-step rate."""
    groups: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for row in rows:
        if row["precision"] in ("amp_bf16", "bf16") and int(row["seq_len"]) >= 4096:
            key = (row["gpu"], row["table"], row["model"], row["n_gpus"], row["activation_checkpointing"])
            groups.setdefault(key, []).append(row)
    rates: dict[str, list[float]] = {}
    for (gpu, _table, model, _n, checkpointed), runs in sorted(groups.items()):
        arch = models[model]
        per_t = (9 if _bool(checkpointed) else 7) * int(arch["n_layers"]) * int(arch["d_model"])
        runs.sort(key=lambda r: int(r["seq_len"]))
        for a, b in zip(runs, runs[1:], strict=False):
            extra_s = 1 / float(b["throughput_tokens_per_s_per_gpu"]) - 1 / float(a["throughput_tokens_per_s_per_gpu"])
            extra_flops = per_t * (int(b["seq_len"]) - int(a["seq_len"]))
            if extra_s > 0:
                rates.setdefault(gpu, []).append(extra_flops / extra_s / 1e12)
    return rates


def fit_main() -> int:
    """Fit each profile's Triton attention rate and ``step_efficiency`` on the fit half; print them
    and the test half's errors with them."""
    models = {m["model"]: m for m in read_csv(MODELS_CSV)}
    rows = read_csv(RUNS_CSV)
    halves = split_half(rows)
    fitted: dict[str, HardwareProfile] = {}
    for profile in sorted({HARDWARE[r["gpu"]] for r in rows if r["gpu"] in HARDWARE}):
        fit_rows = [r for r, h in zip(rows, halves, strict=True) if h == "fit" and HARDWARE.get(r["gpu"]) == profile]
        hardware, error, long_error = fit_profile(fit_rows, models, profile)
        fitted[profile] = hardware
        rate = next(c.tflops[0] for c in hardware.attention_curves if c.kernel is AttentionKernel.FLASH_TRITON)
        print(f"{profile}: step_efficiency {hardware.step_efficiency}, flash-triton causal {rate} TFLOP/s "
              f"(fit half: {len(fit_rows)} rows, median error {error:+.1%}; >= 8k tokens {long_error:+.1%})")
    print("\nModel-free marginal attention rates of the fit half (marginal_attention_rates), TFLOP/s:")
    fit_half = [r for r, h in zip(rows, halves, strict=True) if h == "fit"]
    for gpu, rates in marginal_attention_rates(fit_half, models).items():
        print(f"  {gpu}: median {statistics.median(rates):.0f} over {len(rates)} pairs "
              f"({min(rates):.0f}-{max(rates):.0f})")
    test = [plan_row(r, models, fitted) for r, h in zip(rows, halves, strict=True) if h == "test"]
    print("\nTest half, with the fitted values:")
    print_summary(summarize(test))
    return 0


if __name__ == "__main__":
    sys.exit(fit_main())
