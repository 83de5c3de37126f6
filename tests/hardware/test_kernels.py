"""Kernel efficiencies from published benchmarks (docs/kernel_benchmarks.md): the GEMM shape
law against measured GEMM tables, attention curves by kernel, and which rate each op gets."""

from __future__ import annotations

import math

import pytest

from hardware.dtypes import ComputePrecision
from hardware.kernels import AttentionCurve, AttentionKernel, AttentionShape, Direction, GemmShape, gemm_shape_factor
from hardware.registry import load_hardware
from hardware.roofline import op_time
from planner.model.config import ModelConfig
from planner.ops.base import LayerCost, TensorInfo
from planner.timing.op_times import kernel_rate

H100, A100 = load_hardware("h100-sxm"), load_hardware("a100-sxm-80gb")


def _gemm_tflops(hw, m: int, n: int, k: int, precision: ComputePrecision = ComputePrecision.BF16) -> float:  # noqa: ANN001
    flops = 2.0 * m * n * k
    rate = hw.achievable_flops_per_s(precision) * gemm_shape_factor(GemmShape(m=m, n=n, k=k), hw.gemm_half_dim)
    return flops / op_time(flops, 0.0, precision, hw, 1, rate).time_s / 1e12


# XLA's measured sm_90 bf16 matmul table (third_party/xla/.../matmul_interpolator_data.h; docs
# 1.2): small, skinny and large GEMMs within 20% (the law has one fitted constant, d_half = 128).
@pytest.mark.parametrize(("m", "n", "k", "measured"), [
    (512, 512, 512, 40.7), (1024, 1024, 1024, 236.3), (2048, 2048, 2048, 632.0), (4096, 4096, 4096, 783.3),
    (4096, 4096, 256, 392.2), (4096, 4096, 1024, 677.4), (256, 4096, 4096, 412.0), (1024, 4096, 4096, 738.5),
])
def test_gemm_law_reproduces_the_h100_table(m: int, n: int, k: int, measured: float) -> None:
    assert _gemm_tflops(H100, m, n, k) == pytest.approx(measured, rel=0.20)


# Azure's A100 SXM4 80GB cuBLASLt fp16 sweep (superbench; docs 1.2), a different GPU and library
# than the fit: within 15%.
@pytest.mark.parametrize(("size", "measured"), [(1024, 119.4), (2048, 221.8), (4096, 228.0), (8192, 253.7)])
def test_gemm_law_reproduces_the_a100_cublaslt_sweep(size: int, measured: float) -> None:
    assert _gemm_tflops(A100, size, size, size, ComputePrecision.FP16) == pytest.approx(measured, rel=0.15)


def test_a_one_tile_wave_model_contradicts_the_measured_table() -> None:
    """Why tile and wave quantization are no separate term (docs/kernel_benchmarks.md 1.3): with
    NVIDIA's guide's 256x128 tile, one per SM (its A100 example), M=256, N=K=4096 on an H100 (132
    SMs) is 1 x 32 = 32 tiles in one wave, 24% of the SMs busy: at most 0.24 x 989 = 240 TFLOP/s,
    where XLA measured 412 (cuBLAS picks other tiles or splits K). The shape law, fitted to measured
    tables, carries what quantization costs them; it is within 20% of this shape."""
    tiles = math.ceil(256 / 256) * math.ceil(4096 / 128)
    one_wave_bound = tiles / 132 * 989.4
    assert one_wave_bound < 0.6 * 412.0
    assert _gemm_tflops(H100, 256, 4096, 4096) == pytest.approx(412.0, rel=0.20)


def test_gemm_factor_is_one_for_huge_gemms_and_falls_for_small_dims() -> None:
    assert gemm_shape_factor(GemmShape(m=10**7, n=10**7, k=10**7), 128) == pytest.approx(1.0, abs=1e-4)
    factors = [gemm_shape_factor(GemmShape(m=8192, n=8192, k=k), 128) for k in (64, 256, 1024, 8192)]
    assert factors == sorted(factors)
    assert gemm_shape_factor(GemmShape(m=1, n=1, k=1), 0) == 1.0  # no fall-off configured


def test_attention_curve_interpolates_in_log_seq_len_and_clamps() -> None:
    curve = AttentionCurve(kernel=AttentionKernel.FLASH2, direction=Direction.FWD_BWD, causal=True, head_dim=128,
                           seq_lens=(1024, 4096), tflops=(100.0, 200.0), source="test")
    assert curve.flops_per_s(2048) == pytest.approx(150e12)
    assert curve.flops_per_s(256) == pytest.approx(100e12)
    assert curve.flops_per_s(65536) == pytest.approx(200e12)
    with pytest.raises(ValueError, match="seq_lens"):
        AttentionCurve(kernel=AttentionKernel.FLASH2, direction=Direction.FWD, causal=True, head_dim=64,
                       seq_lens=(4096, 1024), tflops=(1.0, 2.0), source="test")


def _attention(kernel: AttentionKernel | None = None, fused: bool = True, seq: int = 4096, head_dim: int = 128,
               causal: bool = True) -> LayerCost:
    return LayerCost(fwd_flops=1e12, matmul=True, output=TensorInfo(numel=1, dtype="bf16"),
                     attention=AttentionShape(seq_len=seq, head_dim=head_dim, causal=causal, fused=fused, kernel=kernel))


def test_fused_attention_gets_its_kernels_published_rate() -> None:
    # A100, FlashAttention-2, causal, head dim 128, 4k: 173 TFLOP/s forward+backward (README figure)
    assert kernel_rate(_attention(), ComputePrecision.BF16, A100, Direction.FWD) == pytest.approx(173e12)
    # H100 cuDNN forward, causal d128 at 4k: 518 TFLOP/s (FA3 paper Fig. 5), when the model names it
    assert kernel_rate(_attention(AttentionKernel.CUDNN), ComputePrecision.BF16, H100, Direction.FWD) == \
        pytest.approx(518e12)
    # FA3 is faster than FA2 on H100 at every length
    for seq in (512, 2048, 16384):
        fa2 = kernel_rate(_attention(seq=seq), ComputePrecision.BF16, H100, Direction.FWD)
        fa3 = kernel_rate(_attention(AttentionKernel.FLASH3, seq=seq), ComputePrecision.BF16, H100, Direction.FWD)
        assert fa3 is not None and fa2 is not None and fa3 > fa2


def test_eager_attention_runs_at_the_math_paths_rate() -> None:
    rate = kernel_rate(_attention(fused=False, causal=False), ComputePrecision.BF16, A100, Direction.BWD)
    assert rate == pytest.approx(79e12)  # PyTorch eager, non-causal d128 at 4k, A100
    fused = kernel_rate(_attention(causal=False), ComputePrecision.BF16, A100, Direction.BWD)
    assert fused is not None and fused > 2 * rate


def test_attention_without_a_curve_falls_back_to_the_gemm_rate() -> None:
    assert kernel_rate(_attention(), ComputePrecision.FP32, A100, Direction.FWD) is None  # fp32: no curve
    l4 = load_hardware("l4")
    assert kernel_rate(_attention(), ComputePrecision.BF16, l4, Direction.FWD) is None  # no published curves


def test_long_context_attention_is_slower_per_flop_than_the_gemms() -> None:
    """Regression: attention was priced at the GEMM efficiency (0.75 of peak), so long-context
    plans read 60-170% optimistic against llm-foundry's H100 runs."""
    rate = kernel_rate(_attention(seq=16384), ComputePrecision.BF16, H100, Direction.FWD)
    assert rate is not None and rate < 0.4 * H100.peak_flops_per_s[ComputePrecision.BF16]


def test_a_model_file_can_name_the_kernel() -> None:
    from planner.graph.layer_graph import build_graph
    from planner.precision import precision_spec

    model = ModelConfig(family="llama", n_layers=1, d_model=256, n_heads=2, d_ff=512, vocab_size=100,
                        attention_kernel="flash3")
    graph = build_graph(model, 1, 2048, precision_spec("bf16-mixed"))
    core = graph.node("blocks.0.attn.core").cost.attention
    assert core is not None and core.kernel is AttentionKernel.FLASH3
    with pytest.raises(ValueError, match="attention_kernel"):
        ModelConfig(family="llama", n_layers=1, d_model=256, n_heads=2, d_ff=512, vocab_size=100,
                    attention_kernel="triton-nightly")


def test_the_triton_kernel_runs_at_its_fitted_rate_where_one_is_fitted() -> None:
    """llm-foundry's Triton FlashAttention (attention_kernel: flash-triton) runs at the rate fitted to
    its published runs (docs/kernel_benchmarks.md 2.7): well below FlashAttention-2 on the same GPU,
    flat in sequence length; the figure belongs to the llm-foundry stack (hardware/stacks), so the bare
    profile and a profile without that figure fall back to the GEMM rate."""
    from hardware.stack import Stack, on_stack

    foundry = on_stack(A100, Stack.LLM_FOUNDRY)
    for seq in (4096, 65536):
        triton = kernel_rate(_attention(AttentionKernel.FLASH_TRITON, seq=seq), ComputePrecision.BF16, foundry,
                             Direction.FWD)
        fa2 = kernel_rate(_attention(AttentionKernel.FLASH2, seq=seq), ComputePrecision.BF16, foundry, Direction.FWD)
        assert triton is not None and fa2 is not None and 0.5 * fa2 < triton < 0.8 * fa2
    curve = next(c for c in foundry.attention_curves if c.kernel is AttentionKernel.FLASH_TRITON)
    assert curve.source.startswith("fitted")
    assert kernel_rate(_attention(AttentionKernel.FLASH_TRITON), ComputePrecision.BF16, A100, Direction.FWD) is None
    assert kernel_rate(_attention(AttentionKernel.FLASH_TRITON), ComputePrecision.BF16, load_hardware("b200"),
                       Direction.FWD) is None


def test_memory_bound_kernels_run_at_their_class_share_of_bandwidth() -> None:
    """Eager norms reach about 53% of HBM bandwidth on an A100, elementwise ops 65%, a copy 79%
    (docs/kernel_benchmarks.md 3): an op's memory time uses its class's share."""
    from hardware.kernels import MemoryClass

    n_bytes = 1e9
    copy = op_time(0.0, n_bytes, ComputePrecision.FP32, A100, 0).time_s
    norm = op_time(0.0, n_bytes, ComputePrecision.FP32, A100, 0, memory_class=MemoryClass.NORM).time_s
    add = op_time(0.0, n_bytes, ComputePrecision.FP32, A100, 0, memory_class=MemoryClass.ELEMENTWISE).time_s
    assert copy == pytest.approx(n_bytes / (A100.hbm_bandwidth_bytes_per_s * 0.79))
    assert norm == pytest.approx(n_bytes / (A100.hbm_bandwidth_bytes_per_s * 0.53))
    assert add == pytest.approx(n_bytes / (A100.hbm_bandwidth_bytes_per_s * 0.65))
    l4 = load_hardware("l4")  # no class figures: every class at the copy rate
    assert l4.achievable_bandwidth_bytes_per_s(MemoryClass.NORM) == l4.achievable_bandwidth_bytes_per_s()


def test_norm_ops_are_priced_as_norms() -> None:
    from hardware.kernels import MemoryClass
    from planner.ops.base import OpKind
    from planner.timing.op_times import MEMORY_CLASS

    assert MEMORY_CLASS[OpKind.RMSNORM] is MemoryClass.NORM and MEMORY_CLASS[OpKind.LAYERNORM] is MemoryClass.NORM
    assert MEMORY_CLASS[OpKind.RESIDUAL_ADD] is MemoryClass.ELEMENTWISE
    # the eager CrossEntropyLoss row (A100, fp32 16384 x 32768, docs/kernel_benchmarks.md 3.2): fwd+bwd
    # 15.49 ms for the 7 passes over 2.15 GB of logits the formula counts = 0.97 TB/s, 48% of 2.039
    assert MEMORY_CLASS[OpKind.CROSS_ENTROPY] is MemoryClass.SOFTMAX
    a100 = load_hardware("a100-sxm-80gb")
    assert 7 * 16384 * 32768 * 4 / 15.49e-3 / a100.hbm_bandwidth_bytes_per_s == pytest.approx(
        a100.memory_efficiency_by_class[MemoryClass.SOFTMAX], abs=0.005)


def test_flash2_on_h100_is_priced_by_direction_where_published() -> None:
    """FlashAttention-2's forward is published on its own for H100 (FA3 paper Fig. 5, FA2 bars):
    the forward uses it; the backward uses the transcribed backward figure where there is one
    (non-causal) and the README's forward+backward figure otherwise (docs/kernel_benchmarks.md 2.3-2.4).
    On A100 only the forward+backward figure is readable, so both directions use it."""
    causal_fwd = kernel_rate(_attention(seq=8192), ComputePrecision.BF16, H100, Direction.FWD)
    causal_bwd = kernel_rate(_attention(seq=8192), ComputePrecision.BF16, H100, Direction.BWD)
    assert causal_fwd == pytest.approx(333e12) and causal_bwd == pytest.approx(308e12)
    assert kernel_rate(_attention(seq=8192, causal=False), ComputePrecision.BF16, H100, Direction.BWD) == \
        pytest.approx(318e12)
    assert kernel_rate(_attention(seq=4096), ComputePrecision.BF16, A100, Direction.FWD) == kernel_rate(
        _attention(seq=4096), ComputePrecision.BF16, A100, Direction.BWD) == pytest.approx(173e12)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_transcribed_flash2_backward_agrees_with_the_published_forward_and_total(head_dim: int) -> None:
    """The FA2 backward bars on H100 exist only as a secondary transcription (docs 2.4). Checked:
    with the FA3 paper's FA2 forward bars (read from the figure) they give the FlashAttention
    README's non-causal forward+backward within 6% at every length (FLOPs: backward = 2.5 x forward,
    so the total rate is 3.5 / (1/fwd + 2.5/bwd)); read as causal they would miss by 27-37% at 512 tokens."""
    def curve(direction: Direction, causal: bool) -> AttentionCurve:
        return next(c for c in H100.attention_curves if c.kernel is AttentionKernel.FLASH2
                    and c.direction is direction and c.causal is causal and c.head_dim == head_dim)
    fwd, bwd = curve(Direction.FWD, False), curve(Direction.BWD, False)
    total, causal_total, causal_fwd = (curve(Direction.FWD_BWD, False), curve(Direction.FWD_BWD, True),
                                       curve(Direction.FWD, True))
    worst_as_causal = 0.0
    for seq in fwd.seq_lens:
        combined = 3.5 / (1 / fwd.flops_per_s(seq) + 2.5 / bwd.flops_per_s(seq))
        assert combined == pytest.approx(total.flops_per_s(seq), rel=0.06)
        as_causal = 3.5 / (1 / causal_fwd.flops_per_s(seq) + 2.5 / bwd.flops_per_s(seq))
        worst_as_causal = max(worst_as_causal, abs(as_causal / causal_total.flops_per_s(seq) - 1))
    assert worst_as_causal > 0.15


def test_a_backward_published_for_one_causality_is_derived_for_the_other() -> None:
    """cuDNN's H100 backward is published non-causal only (docs/kernel_benchmarks.md 2.4): the causal
    backward is that curve times cuDNN's causal/non-causal forward ratio at each length, well under
    the large-GEMM rate it fell back to before; a kernel with no backward curve at all still falls back."""
    from hardware.kernels import pick_curve

    h100 = load_hardware("h100-sxm")
    causal = pick_curve(h100.attention_curves, AttentionKernel.CUDNN, True, 128, Direction.BWD)
    plain = pick_curve(h100.attention_curves, AttentionKernel.CUDNN, False, 128, Direction.BWD)
    fwd_c = pick_curve(h100.attention_curves, AttentionKernel.CUDNN, True, 128, Direction.FWD)
    fwd_n = pick_curve(h100.attention_curves, AttentionKernel.CUDNN, False, 128, Direction.FWD)
    assert causal is not None and plain is not None and fwd_c is not None and fwd_n is not None
    assert causal.source.startswith("derived") and causal.causal
    for n in (512, 4096, 16384):
        ratio = fwd_c.flops_per_s(n) / fwd_n.flops_per_s(n)
        assert causal.flops_per_s(n) == pytest.approx(plain.flops_per_s(n) * ratio, rel=1e-3)
        assert causal.flops_per_s(n) < 0.7 * h100.achievable_flops_per_s(ComputePrecision.BF16)
    assert pick_curve(load_hardware("a100-sxm-80gb").attention_curves, AttentionKernel.CUDNN, True, 128,
                      Direction.BWD) is None
