"""Kernel curves on this device against the profile's: GEMM TFLOP/s by shape, attention (SDPA)
TFLOP/s by sequence length, forward and backward.

    python benchmarks/gpu_kernels.py --hardware h200 --out docs/kernels_measured.md   # on a GPU
    python benchmarks/gpu_kernels.py --device cpu --quick --out /tmp/k.md              # smoke test

GEMMs: bf16 ``torch.mm`` over the shapes of XLA's sm_90 table (docs/kernel_benchmarks.md 1.2) and
the shapes a transformer step runs; attention: ``F.scaled_dot_product_attention`` causal, bf16,
hidden 2048 (heads = 2048 / head dim), batch = 16k / seq_len, as the FlashAttention benchmarks
size it, with causal FLOPs counted as half and the backward as 2.5 x the forward (their
convention). Times: CUDA events, median of ``--repeats`` after warm-up. Each row puts the
measured rate beside the profile's prediction (``hardware.kernels``), so the curves in the
profile can be replaced by what this device measures.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from hardware.dtypes import ComputePrecision
from hardware.kernels import Direction, GemmShape, gemm_shape_factor, pick_curve
from hardware.registry import load_hardware
from hardware.roofline import op_time

GEMMS = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 4096, 256),
         (4096, 4096, 1024), (256, 4096, 4096), (16384, 4096, 4096), (16384, 14336, 4096), (16384, 4096, 14336)]
SEQ_LENS = [512, 1024, 2048, 4096, 8192, 16384]


def _timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def gemm_rows(hw_name: str, device: str, dtype: torch.dtype, repeats: int, quick: bool) -> list[str]:
    hw = load_hardware(hw_name)
    rows = []
    for m, n, k in ([(256, 256, 256)] if quick else GEMMS):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = _timed(lambda a=a, b=b: torch.mm(a, b), device, repeats)
        flops = 2.0 * m * n * k
        rate = hw.achievable_flops_per_s(ComputePrecision.BF16) * gemm_shape_factor(GemmShape(m=m, n=n, k=k),
                                                                                     hw.gemm_half_dim)
        predicted = flops / op_time(flops, 0.0, ComputePrecision.BF16, hw, 1, rate).time_s
        measured = flops / seconds
        rows.append(f"| {m}x{n}x{k} | {predicted / 1e12:.1f} | {measured / 1e12:.1f} | {measured / predicted - 1:+.1%} |")
        print(rows[-1], flush=True)
    return rows


def attention_rows(hw_name: str, device: str, dtype: torch.dtype, repeats: int, quick: bool) -> list[str]:
    hw = load_hardware(hw_name)
    rows = []
    for head_dim in ((64,) if quick else (64, 128)):
        heads = 2 if quick else 2048 // head_dim
        for seq in ((128,) if quick else SEQ_LENS):
            batch = 1 if quick else max(1, 16384 // seq)
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            fwd_flops = 4.0 * batch * heads * seq * seq * head_dim / 2  # causal: half
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.randn_like(out)
            fwd_s = _timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True), device,
                           repeats)
            bwd_s = _timed(lambda out=out, grad=grad, q=q, k=k, v=v: torch.autograd.grad(out, (q, k, v), grad,
                                                                                      retain_graph=True),
                           device, repeats)
            for direction, flops, seconds in ((Direction.FWD, fwd_flops, fwd_s), (Direction.BWD, 2.5 * fwd_flops, bwd_s)):
                curve = pick_curve(hw.attention_curves, hw.attention_kernel, True, head_dim, direction)
                predicted = curve.flops_per_s(seq) / 1e12 if curve else float("nan")
                measured = flops / seconds / 1e12
                rows.append(f"| {hw.attention_kernel.value} (profile) | {direction.value} | {head_dim} | {seq} | "
                            f"{predicted:.1f} | {measured:.1f} | {measured / predicted - 1:+.1%} |")
                print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--hardware", default="h200", help="bundled profile of this GPU")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="two GEMMs and one attention length (smoke test)")
    parser.add_argument("--out", default="docs/kernels_measured.md")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device; use --device cpu --quick for a smoke test", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    gemms = gemm_rows(args.hardware, args.device, dtype, args.repeats, args.quick)
    attention = attention_rows(args.hardware, args.device, dtype, args.repeats, args.quick)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if args.device == "cuda" else "")
    Path(args.out).write_text("\n".join([
        f"# Kernel curves measured on {name}", "",
        f"{versions}, {stamp}, `benchmarks/gpu_kernels.py --hardware {args.hardware}`; median of {args.repeats} "
        "timed calls after warm-up. Predicted: the profile's figures (hardware/kernels.py).", "",
        "## GEMM (bf16 torch.mm)", "", "| M x N x K | predicted TFLOP/s | measured TFLOP/s | error |", "|---|---:|---:|---:|",
        *gemms, "", "## Attention (SDPA, causal, bf16; causal FLOPs counted as half, backward 2.5 x forward)", "",
        "| kernel | direction | head dim | seq | predicted TFLOP/s | measured TFLOP/s | error |",
        "|---|---|---:|---:|---:|---:|---:|", *attention, ""]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
