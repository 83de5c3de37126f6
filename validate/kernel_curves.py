"""Measure the kernel curves a profile holds (``hardware.kernels``) on this device: the GEMM
shape fall-off and SDPA attention TFLOP/s by sequence length, forward and backward.

Used by ``hardware calibrate --device cuda`` (the measured curves replace the published ones in
the written profile) and by ``benchmarks/gpu_kernels.py``. Attention follows the FlashAttention
benchmarks' sizing and FLOP convention (hidden 2048, batch = 16k / seq_len, causal FLOPs counted
as half, backward 2.5 x forward), so measured and published curves are comparable.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from hardware.kernels import AttentionCurve, AttentionKernel, Direction, GemmShape, gemm_shape_factor

# shapes that separate the fall-off: square sizes and skinny K / M at 4096 (XLA's sm_90 table's)
GEMM_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 4096, 256), (4096, 4096, 1024),
               (256, 4096, 4096), (8192, 8192, 8192))
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)


def timed_s(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median seconds per call after warm-up (CUDA events on a GPU, wall clock elsewhere)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def gemm_rates(device: torch.device, dtype: torch.dtype, shapes: Sequence[tuple[int, int, int]] = GEMM_SHAPES,
               repeats: int = 10) -> dict[tuple[int, int, int], float]:
    """Achieved FLOP/s of ``torch.mm`` per (M, N, K)."""
    rates = {}
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        rates[(m, n, k)] = 2.0 * m * n * k / timed_s(partial(torch.mm, a, b), device, repeats)
    return rates


def fit_gemm_half_dim(rates: dict[tuple[int, int, int], float], launch_s: float) -> tuple[float, float]:
    """(large-GEMM FLOP/s, d_half) that best reproduce ``rates`` under
    ``time = launch + flops / (rate x prod d/(d+d_half))`` (least squares on log time, grid over d_half)."""
    best: tuple[float, float, float] | None = None
    for half in (0.0, *(2.0 ** (i / 4) for i in range(16, 49))):  # 16 .. 4096
        # with d_half fixed, the best rate is the geometric mean of the implied rates
        implied = [2.0 * m * n * k / max(1e-12, 2.0 * m * n * k / r - launch_s) / gemm_shape_factor(
            GemmShape(m=m, n=n, k=k), half) for (m, n, k), r in rates.items()]
        rate = math.exp(statistics.fmean(math.log(x) for x in implied))
        error = 0.0
        for (m, n, k), measured in rates.items():
            flops = 2.0 * m * n * k
            predicted_s = launch_s + flops / (rate * gemm_shape_factor(GemmShape(m=m, n=n, k=k), half))
            error += math.log(predicted_s / (flops / measured)) ** 2
        if best is None or error < best[0]:
            best = (error, rate, half)
    assert best is not None
    return best[1], best[2]


def attention_curves(device: torch.device, dtype: torch.dtype, kernel: AttentionKernel, source: str,
                     head_dims: Sequence[int] = (64, 128), seq_lens: Sequence[int] = SEQ_LENS,
                     hidden: int = 2048, tokens: int = 16384, repeats: int = 10) -> list[AttentionCurve]:
    """Causal SDPA forward and backward TFLOP/s per head dim, by sequence length (whatever
    kernel torch picks here; ``kernel`` labels the curves)."""
    curves = []
    for head_dim in head_dims:
        heads = max(1, hidden // head_dim)
        fwd, bwd = [], []
        for seq in seq_lens:
            batch = max(1, tokens // seq)
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            flops = 4.0 * batch * heads * seq * seq * head_dim / 2  # causal: half the square
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.randn_like(out)
            forward = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
            backward = partial(torch.autograd.grad, out, (q, k, v), grad, retain_graph=True)
            fwd.append(flops / timed_s(forward, device, repeats) / 1e12)
            bwd.append(2.5 * flops / timed_s(backward, device, repeats) / 1e12)
        for direction, values in ((Direction.FWD, fwd), (Direction.BWD, bwd)):
            curves.append(AttentionCurve(kernel=kernel, direction=direction, causal=True, head_dim=head_dim,
                                         seq_lens=tuple(seq_lens), tflops=tuple(float(f"{x:.4g}") for x in values),
                                         source=source))
    return curves
