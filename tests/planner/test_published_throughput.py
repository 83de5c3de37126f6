"""Step time against published throughput: torchtitan's FSDP2 runs on 64 A100 80GB GPUs.

Source: pytorch/torchtitan docs/performance.md ("Llama 3 performance numbers" and "Llama 2
performance numbers", FSDP2 1D parallelism on 64 A100 (80GB) GPUs, bf16 mixed precision with
fp32 gradient reduction, which is roofplan's ``bf16-mixed`` under ZeRO-3). WPS there is tokens per
second per GPU; Llama 3 runs at sequence length 8192, Llama 2 at 4096; global batch = local batch
x 64. "selective layer" AC checkpoints every second block (torchtitan's ``selective_ac_option: 2``:
the 2nd, 4th, ... block), "full" every block. "selective op" AC (save matmul outputs, recompute
the rest) is finer than roofplan's block-level checkpointing, so that run is checked to lie between
the predictions without and with full checkpointing.

What this proves and what it does not: these are end-to-end GPU figures measured by others, so
they test the whole time model (kernel efficiencies from published kernel benchmarks, the
a100-sxm-80gb profile's step_efficiency fitted on llm-foundry's runs, not on these; FSDP2
communication as NCCL runs it over 8 nodes, and its overlap) on real runs, not any one number. The
source does not state the network; the profile assumes a DGX A100 (one 200 Gb/s HDR NIC per GPU, as
in Meta's Research SuperCluster). Observed on this commit: every run optimistic by 6-9% (+6.1% to +8.6%;
docs/validation.md); the tolerance is 10%. A run that ran must also be predicted to fit in 80 GB.
"""

from __future__ import annotations

import pytest

from planner.plan.knobs import Knobs
from roofplan import api

GPUS = 64
TOLERANCE = 0.10


def _tokens_per_s_per_gpu(preset: str, micro_batch: int, seq_len: int, checkpointed: str) -> tuple[float, bool]:
    model, training = api.load_model(preset, seq_len=seq_len, global_batch_size=micro_batch * GPUS, stack="torchtitan")
    blocks = {"none": (), "full": tuple(range(model.n_layers)),
              "selective layer": tuple(range(1, model.n_layers, 2))}[checkpointed]
    knobs = Knobs(micro_batch_size=micro_batch, grad_accum_steps=1, precision="bf16-mixed", data_parallel=GPUS,
                  zero_stage=3, checkpoint_blocks=blocks)
    estimate = api.estimate_plan(model, training, "a100-sxm-80gb", knobs).best.estimate
    return estimate.tokens_per_s / GPUS, estimate.memory.fits


@pytest.mark.parametrize(("preset", "micro_batch", "seq_len", "checkpointed", "published_wps"), [
    ("llama3-8b", 1, 8192, "selective layer", 2904),
    ("llama3-70b", 1, 8192, "full", 331),
    ("llama2-13b", 2, 4096, "none", 2162),
    ("llama2-13b", 2, 4096, "selective layer", 1914),
    ("llama2-70b", 2, 4096, "full", 353),
])
def test_torchtitan_a100_runs(preset: str, micro_batch: int, seq_len: int, checkpointed: str,
                              published_wps: int) -> None:
    predicted, fits = _tokens_per_s_per_gpu(preset, micro_batch, seq_len, checkpointed)
    assert fits, f"{preset} ran on 80 GB GPUs in torchtitan, but the planner says it does not fit"
    assert predicted == pytest.approx(published_wps, rel=TOLERANCE), (
        f"{preset} ({checkpointed} AC): predicted {predicted:.0f} tokens/s/GPU, torchtitan measured {published_wps}")


def test_torchtitan_selective_op_run_lies_between_no_and_full_checkpointing() -> None:
    """Llama 3 8B with selective op AC measured 2,973 tokens/s/GPU: it recomputes less than full
    checkpointing and more than none, so it lies between the two predictions (5% slack: observed
    2,785 and 3,447)."""
    fastest, _ = _tokens_per_s_per_gpu("llama3-8b", 1, 8192, "none")
    slowest, fits = _tokens_per_s_per_gpu("llama3-8b", 1, 8192, "full")
    assert fits
    assert slowest * 0.95 <= 2973 <= fastest * 1.05, (slowest, fastest)
