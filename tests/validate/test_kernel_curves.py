"""The kernel-curve measurements `hardware calibrate --device cuda` writes into a profile: the
GEMM law fit recovers known parameters, and the attention curves are valid profile data."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hardware.kernels import AttentionKernel, Direction, GemmShape, gemm_shape_factor  # noqa: E402
from validate.kernel_curves import attention_curves, fit_gemm_half_dim  # noqa: E402


def test_gemm_fit_recovers_the_law_it_was_generated_from() -> None:
    launch, rate, half = 5e-6, 800e12, 128.0
    shapes = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 4096, 256), (256, 4096, 4096)]
    rates = {}
    for m, n, k in shapes:
        flops = 2.0 * m * n * k
        rates[(m, n, k)] = flops / (launch + flops / (rate * gemm_shape_factor(GemmShape(m=m, n=n, k=k), half)))
    fitted_rate, fitted_half = fit_gemm_half_dim(rates, launch)
    assert fitted_half == pytest.approx(half, rel=0.1)  # the grid steps by 2^(1/4)
    assert fitted_rate == pytest.approx(rate, rel=0.1)


def test_attention_curves_on_the_cpu_are_profile_data() -> None:
    curves = attention_curves(torch.device("cpu"), torch.float32, AttentionKernel.FLASH2, "measured here",
                              head_dims=(32,), seq_lens=(64, 128), hidden=64, tokens=128, repeats=2)
    assert [(c.direction, c.head_dim) for c in curves] == [(Direction.FWD, 32), (Direction.BWD, 32)]
    for curve in curves:
        assert curve.causal and curve.seq_lens == (64, 128) and min(curve.tflops) > 0


def test_kernel_curve_script_runs_on_the_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """benchmarks/gpu_kernels.py (GEMM and attention curves beside the profile's) runs end to end."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"
    out = tmp_path / "kernels.md"
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--device", "cpu", "--repeats", "2",
                                      "--hardware", "h100-sxm", "--out", str(out)])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(script), run_name="__main__")
    assert not stop.value.code
    text = out.read_text()
    assert "## GEMM" in text and "## Attention" in text and "GEMM law fitted here" in text
    assert text.count("| flash2 (profile) |") == 2  # forward and backward, beside the profile's figure
