"""Where a plan's time comes from: the kernel figures behind its step time and MFU, for the report.

Each line names the figure the time model used for this plan and where it was measured, so a
user can check it (the profiles' ``sources`` and docs/kernel_benchmarks.md hold the citations).
"""

from __future__ import annotations

from hardware.collectives import bus_bandwidth_bytes_per_s
from hardware.dtypes import ComputePrecision
from hardware.kernels import AttentionKernel, Direction, pick_curve
from hardware.profile import HardwareProfile
from planner.config import AttentionImpl, ModelConfig


def _attention_line(model: ModelConfig, seq_len: int, hw: HardwareProfile) -> str:
    fused = model.attention is AttentionImpl.FLASH
    kernel = (model.attention_kernel or hw.attention_kernel) if fused else AttentionKernel.MATH
    curve = pick_curve(hw.attention_curves, kernel, fused, model.head_dim, Direction.FWD)
    if curve is None:
        return f"{kernel.value}: no published figures for this device; priced at the GEMM efficiency"
    rate = curve.flops_per_s(seq_len) / 1e12
    causal = "causal" if fused else "full square"
    return (f"{kernel.value}, {causal}, head dim {curve.head_dim}, {seq_len} tokens: {rate:.0f} TFLOP/s "
            f"({curve.direction.value.replace('_', '+')}; {curve.source})")


def time_sources(model: ModelConfig, seq_len: int, hw: HardwareProfile, precision: ComputePrecision,
                 gpus: int, gpus_per_node: int) -> list[tuple[str, str]]:
    """(what, figure and source) for each kernel class the step time is built from."""
    rows = [
        ("GEMMs", f"{hw.compute_efficiency[precision]:.0%} of the {precision.value} peak for large GEMMs"
                  + (f", x d/(d+{hw.gemm_half_dim:g}) per dimension for smaller ones" if hw.gemm_half_dim else "")
                  + " (measured matmul benchmarks, profile sources)"),
        ("attention", _attention_line(model, seq_len, hw)),
        ("memory-bound ops", f"{hw.memory_efficiency:.0%} of {hw.hbm_bandwidth_bytes_per_s / 1e12:.2f} TB/s"
                             + "".join(f", {kind.value} {share:.0%}" for kind, share in hw.memory_efficiency_by_class.items())
                             + f" (measured kernels), {hw.kernel_launch_s * 1e6:.1f} µs per kernel"),
    ]
    if hw.step_efficiency < 1.0:
        rows.append(("in a real step", f"kernels at {hw.step_efficiency:.0%} of their isolated speed (fitted to "
                                       "published end-to-end runs; see checked against)"))
    if gpus > 1:
        bus = bus_bandwidth_bytes_per_s(hw, gpus, gpus_per_node) / 1e9
        rows.append(("collectives", f"NCCL ring/tree model, {bus:.0f} GB/s bus bandwidth over "
                                    f"{'NVLink' if gpus <= gpus_per_node else 'every NIC of a node'} "
                                    "(nccl-tests figures), NCCL's latency per step"))
        if hw.overlap_compute_slowdown:
            rows.append(("overlap", f"compute {hw.overlap_compute_slowdown:.0%} slower while collectives overlap it "
                                    "(published measurement, profile sources)"))
    return rows
