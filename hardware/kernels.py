"""Kernel efficiencies as functions of the kernel, not constants: GEMMs by shape, attention by
kernel, direction, causality, sequence length and head dim. The figures are profile data with
their sources (docs/kernel_benchmarks.md); this module only interpolates them.

GEMM (one ``M x N x K`` matmul): ``time = launch + 2MNK / (peak x compute_efficiency x s)`` with
the shape factor ``s = f(M) f(N) f(K)``, ``f(d) = d / (d + d_half)``: large GEMMs run at the
profile's measured large-GEMM efficiency, small or skinny ones fall off. ``d_half`` (the profile's
``gemm_half_dim``) is fitted to XLA's measured sm_90 bf16 table (docs/kernel_benchmarks.md 1.2:
with 5 µs of launch, 512^3..4096^3 and the K / M sweeps at 4096 are reproduced within about
15%), and checked against Azure's A100 cuBLASLt sweep (1024^3 and 2048^3 within 10%).

Attention: published forward+backward (or forward / backward) TFLOP/s of each kernel at
sequence lengths 512..16k, per head dim and causality, interpolated linearly in log2(seq_len)
and clamped at the ends; the nearest published head dim is used. The sources count causal
FLOPs as half and the backward as 2.5 x the forward, which is how the attention cost formulas
count executed FLOPs. A kernel without curves on a profile falls back to the GEMM efficiency.
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AttentionKernel(StrEnum):
    """What computes ``softmax(q k^T) v``: the fused kernels PyTorch's SDPA can pick on CUDA, and
    the written-out (eager) path."""

    FLASH2 = "flash2"  # FlashAttention-2 (torch's built-in flash backend)
    FLASH3 = "flash3"  # FlashAttention-3 (Hopper; the flash-attn package)
    CUDNN = "cudnn"  # cuDNN's fused attention (torch's cuDNN backend)
    FLASH_TRITON = "flash-triton"  # FlashAttention's Triton kernel (flash_attn_triton.py; llm-foundry's attn_impl: triton)
    MATH = "math"  # matmul, softmax, matmul: torch's math backend and eager attention


class MemoryClass(StrEnum):
    """Memory-bound kernels by what they do: eager PyTorch reaches a different share of the HBM
    bandwidth in each (docs/kernel_benchmarks.md 3.2)."""

    STREAM = "stream"  # copies, casts, gathers: the profile's memory_efficiency (a STREAM-like copy)
    ELEMENTWISE = "elementwise"  # add, activations, dropout, rotary
    NORM = "norm"  # layer_norm, rms_norm (two passes over a row: statistics, then normalize)
    SOFTMAX = "softmax"  # log_softmax and cross-entropy (passes over a row for its max and its sum)


class Direction(StrEnum):
    FWD = "fwd"
    BWD = "bwd"
    FWD_BWD = "fwd_bwd"  # one figure for forward + backward together


class AttentionCurve(BaseModel):
    """Measured TFLOP/s of one kernel at one head dim and causality, by sequence length."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kernel: AttentionKernel
    direction: Direction
    causal: bool
    head_dim: int = Field(gt=0)
    seq_lens: tuple[int, ...] = Field(min_length=1)
    tflops: tuple[float, ...] = Field(min_length=1)
    source: str = Field(min_length=3, description="where the figures are published (docs/kernel_benchmarks.md)")

    @model_validator(mode="after")
    def _aligned(self) -> AttentionCurve:
        if len(self.seq_lens) != len(self.tflops):
            raise ValueError(f"attention curve {self.kernel.value}: {len(self.seq_lens)} seq_lens but "
                             f"{len(self.tflops)} tflops")
        if list(self.seq_lens) != sorted(set(self.seq_lens)) or min(self.tflops) <= 0:
            raise ValueError(f"attention curve {self.kernel.value}: seq_lens must increase and tflops be positive")
        return self

    def flops_per_s(self, seq_len: int) -> float:
        """Linear in log2(seq_len) between published points, clamped at the ends."""
        xs = [math.log2(s) for s in self.seq_lens]
        x = math.log2(max(seq_len, 1))
        if x <= xs[0]:
            return self.tflops[0] * 1e12
        for (x0, y0), (x1, y1) in zip(zip(xs, self.tflops, strict=True), zip(xs[1:], self.tflops[1:], strict=True),
                                      strict=False):
            if x <= x1:
                return (y0 + (y1 - y0) * (x - x0) / (x1 - x0)) * 1e12
        return self.tflops[-1] * 1e12


class GemmShape(BaseModel):
    """One matmul ``(M x K) @ (K x N)``, batched over ``batch``."""

    model_config = ConfigDict(frozen=True)
    m: int
    n: int
    k: int
    batch: int = 1


class AttentionShape(BaseModel):
    """One attention call: what picks its kernel and its curve."""

    model_config = ConfigDict(frozen=True)
    seq_len: int
    head_dim: int
    causal: bool = True
    fused: bool = True  # SDPA's fused kernels; False: the written-out eager path
    kernel: AttentionKernel | None = None  # None: what the profile says PyTorch runs


def gemm_shape_factor(shape: GemmShape, half_dim: float) -> float:
    """``f(M) f(N) f(K)``, ``f(d) = d / (d + half_dim)``: 1 for large GEMMs."""
    if half_dim <= 0:
        return 1.0
    return math.prod(d / (d + half_dim) for d in (shape.m, shape.n, shape.k))


def _nearest(curves: list[AttentionCurve], head_dim: int) -> AttentionCurve | None:
    if not curves:
        return None
    return min(curves, key=lambda c: (abs(math.log2(c.head_dim) - math.log2(head_dim)), c.head_dim))


def pick_curve(curves: tuple[AttentionCurve, ...], kernel: AttentionKernel, causal: bool, head_dim: int,
               direction: Direction) -> AttentionCurve | None:
    """The curve of this kernel and causality in this direction (else the forward+backward one),
    at the nearest head dim; else one derived from the other causality's curve in this direction
    (``_other_causality``); None when the profile has none of these."""
    for wanted in (direction, Direction.FWD_BWD):
        found = _nearest([c for c in curves if c.kernel is kernel and c.causal == causal and c.direction is wanted],
                         head_dim)
        if found is not None:
            return found
    return _other_causality(curves, kernel, causal, head_dim, direction)


def _other_causality(curves: tuple[AttentionCurve, ...], kernel: AttentionKernel, causal: bool, head_dim: int,
                     direction: Direction) -> AttentionCurve | None:
    """A direction published for one causality only (cuDNN's H100 backward: non-causal bars alone,
    docs/kernel_benchmarks.md 2.4): that curve times the kernel's forward ratio of this causality to
    the other at each length, both forward curves published (the causal penalty taken to be the
    same in both directions, an assumption the derived curve's source states)."""
    if direction is not Direction.BWD:  # a forward ratio needs both forward curves: only the backward is derived
        return None

    def one(c: bool, d: Direction) -> AttentionCurve | None:
        return _nearest([x for x in curves if x.kernel is kernel and x.causal == c and x.direction is d], head_dim)

    other, fwd_this, fwd_other = one(not causal, direction), one(causal, Direction.FWD), one(not causal, Direction.FWD)
    if other is None or fwd_this is None or fwd_other is None:
        return None
    tflops = tuple(round(t * fwd_this.flops_per_s(n) / fwd_other.flops_per_s(n), 1)
                   for n, t in zip(other.seq_lens, other.tflops, strict=True))
    which = "causal" if causal else "non-causal"
    return AttentionCurve(kernel=kernel, direction=direction, causal=causal, head_dim=other.head_dim,
                          seq_lens=other.seq_lens, tflops=tflops,
                          source=f"derived: the published {'non-causal' if causal else 'causal'} {direction.value} "
                                 f"curve x the {which}/other forward ratio at each length (no {which} "
                                 f"{direction.value} figure is published; {other.source})")
