"""The GPU validation suite script runs end to end (tiny configurations on the CPU).

The script runs in this process (``runpy``, as ``python benchmarks/gpu_validation.py`` would run
it): a subprocess only added a second torch import.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_validation.py"


def _run_script(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    """The script's exit status, run as ``python SCRIPT *argv``."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return int(stop.value.code or 0)


def test_quick_cpu_run_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "validation.md"
    code = _run_script(monkeypatch, "--quick", "--device", "cpu", "--steps", "2", "--out", str(out))
    assert code == 0, capsys.readouterr().err
    text = out.read_text()
    assert text.count("\n| tiny") == 3
    assert "predicted peak" in text and "+0.0%" in text  # memory is exact on the CPU tracker
    assert "predicted step (cpu profile)" in text  # the bundled profile's step time beside the measured one
    assert "## Kernel curves on this device" in text and "| 128x128x128 |" in text  # GEMM and attention curves


def test_refuses_cuda_without_a_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _run_script(monkeypatch) == 2
    assert "no CUDA device" in capsys.readouterr().err
