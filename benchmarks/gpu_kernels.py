"""Kernel curves on this device against the profile's: GEMM TFLOP/s by shape, attention (SDPA)
TFLOP/s by sequence length, forward and backward.

    python benchmarks/gpu_kernels.py --hardware h200 --out docs/kernels_measured.md   # on a GPU
    python benchmarks/gpu_kernels.py --device cpu --quick --out /tmp/k.md              # smoke test

The measurements are ``validate.kernel_curves`` (the ones ``hardware calibrate --device cuda``
writes into a profile): bf16 ``torch.mm`` over XLA's sm_90 table's shapes, causal SDPA sized and
counted as the FlashAttention benchmarks are (hidden 2048, batch = 16k / seq_len, causal FLOPs as
half, backward 2.5 x forward). Each row puts the measured rate beside the profile's prediction
(``hardware.kernels``), and the fitted GEMM law (large-GEMM rate, ``gemm_half_dim``) beside the
profile's.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from hardware.dtypes import ComputePrecision
from hardware.kernels import GemmShape, gemm_shape_factor, pick_curve
from hardware.profile import HardwareProfile
from hardware.registry import load_hardware
from hardware.roofline import op_time
from validate.kernel_curves import GEMM_SHAPES, SEQ_LENS, attention_curves, fit_gemm_half_dim, gemm_rates


def kernel_sections(device: torch.device, hw: HardwareProfile, quick: bool, repeats: int) -> list[str]:
    """Markdown lines: the GEMM law fitted here beside the profile's, then GEMM and attention rates
    measured on ``device`` beside the profile's predictions."""
    shapes = ((128, 128, 128), (256, 256, 256)) if quick else GEMM_SHAPES
    measured = gemm_rates(device, torch.bfloat16, shapes, repeats)
    rate, half = fit_gemm_half_dim(measured, hw.kernel_launch_s)
    gemm = []
    for (m, n, k), achieved in measured.items():
        flops = 2.0 * m * n * k
        model = hw.achievable_flops_per_s(ComputePrecision.BF16) * gemm_shape_factor(GemmShape(m=m, n=n, k=k),
                                                                                      hw.gemm_half_dim)
        predicted = flops / op_time(flops, 0.0, ComputePrecision.BF16, hw, 1, model).time_s
        gemm.append(f"| {m}x{n}x{k} | {predicted / 1e12:.1f} | {achieved / 1e12:.1f} | {achieved / predicted - 1:+.1%} |")
    curves = attention_curves(device, torch.bfloat16, hw.attention_kernel, "measured", (64,) if quick else (64, 128),
                              (128,) if quick else SEQ_LENS, hidden=128 if quick else 2048,
                              tokens=128 if quick else 16384, repeats=repeats)
    attention = []
    for curve in curves:
        published = pick_curve(hw.attention_curves, curve.kernel, True, curve.head_dim, curve.direction)
        for seq, value in zip(curve.seq_lens, curve.tflops, strict=True):
            expected = published.flops_per_s(seq) / 1e12 if published else float("nan")
            attention.append(f"| {curve.kernel.value} (profile) | {curve.direction.value} | {curve.head_dim} | {seq} | "
                             f"{expected:.1f} | {value:.1f} | {value / expected - 1:+.1%} |")
    return [
        f"GEMM law fitted here: large-GEMM {rate / 1e12:.0f} TFLOP/s, gemm_half_dim {half:.0f} (profile "
        f"{hw.name}: {hw.achievable_flops_per_s(ComputePrecision.BF16) / 1e12:.0f} TFLOP/s, {hw.gemm_half_dim:.0f}).",
        "", "### GEMM (bf16 torch.mm)", "", "| M x N x K | predicted TFLOP/s | measured TFLOP/s | error |",
        "|---|---:|---:|---:|", *gemm, "",
        "### Attention (SDPA, causal, bf16; causal FLOPs counted as half, backward 2.5 x forward)", "",
        "| kernel | direction | head dim | seq | predicted TFLOP/s | measured TFLOP/s | error |",
        "|---|---|---:|---:|---:|---:|---:|", *attention, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--hardware", default="h200", help="bundled profile of this GPU")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test of the script)")
    parser.add_argument("--out", default="docs/kernels_measured.md")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device; use --device cpu --quick for a smoke test", file=sys.stderr)
        return 2
    sections = kernel_sections(torch.device(args.device), load_hardware(args.hardware), args.quick, args.repeats)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if args.device == "cuda" else "")
    text = "\n".join([
        f"# Kernel curves measured on {name}", "",
        f"{versions}, {stamp}, `benchmarks/gpu_kernels.py --hardware {args.hardware}`; median of {args.repeats} "
        "timed calls after warm-up. Predicted: the profile's figures (hardware/kernels.py).", "", *sections])
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
