"""The GPU validation suite script runs end to end (tiny configurations on the CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_validation.py"


def test_quick_cpu_run_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "validation.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.count("\n| tiny") == 3
    assert "predicted peak" in text and "+0.0%" in text  # memory is exact on the CPU tracker


def test_refuses_cuda_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
