"""Step time of tensor- and context-parallel layouts against torchtitan's published H100 runs.

Sources (pytorch/torchtitan, read at the commits named):
- benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @2887250b: FSDP2 x TP 8 with sequence
  parallelism, bf16, torch.compile, seq 8192 (the configs' default at the run's commit 820504e),
  "vanilla TP" rows (async TP is not modelled);
- benchmarks/llama3_h100_202412_torchtitan.md @820504e2, Table 2: Llama 3.1 8B on one node,
  FSDP x CP (torch's context_parallel, all-gather rotation), local batch 1, full activation
  checkpointing, torch.compile and Float8 linears.
Both on Grand Teton H100s with 96 GB of HBM2e at a 500 W power limit; planned on the h100-sxm
profile (80 GB HBM3, 700 W) under the torchtitan-compile stack (its attention kernel; llm-foundry's residual,
borrowed), bf16-mixed FSDP2: compile's fusion and Float8 (faster linears) and the
power limit (slower kernels) are not modelled, so the comparison has known biases both ways. Not
used in any fit. Throughput is tokens per second per GPU as torchtitan counts it (the rank's local
batch x seq before CP sharding, over cp x tp)."""

from __future__ import annotations

import pytest

from hardware.kernels import AttentionKernel
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from roofplan import api

# its module-scoped fixtures are built once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("test_published_parallel_runs")

GIB = 2**30
TORCHTITAN_HBM_BYTES = 96 * GIB  # the runs' GPUs; what they needed fit there


def _per_gpu(name: str, gpus: int, seq_len: int, local_batch: int, tp: int = 1, cp: int = 1,
             checkpoint: bool = True, kernel: str | None = None) -> tuple[float, int]:
    """(predicted tokens/s per GPU, device bytes) for a torchtitan run: FSDP2 (ZeRO-3) over the
    data- and context-parallel ranks, TP with SP."""
    data = gpus // (tp * cp)
    model, training = api.load_model(name, seq_len=seq_len, global_batch_size=local_batch * data,
                                     stack="torchtitan-compile")
    if kernel is not None:
        model = model.model_copy(update={"attention_kernel": AttentionKernel(kernel)})
    knobs = Knobs(micro_batch_size=local_batch, grad_accum_steps=1, precision="bf16-mixed",
                  checkpoint_blocks=range(model.n_layers) if checkpoint else (),
                  parallel=ParallelDims.data_parallel_of(gpus, 3, tp=tp, sp=tp > 1, cp=cp))
    estimate = api.estimate_plan(model, training, "h100-sxm", knobs).best.estimate
    return estimate.tokens_per_s / gpus, estimate.memory.device_bytes


@pytest.mark.filterwarnings("ignore::planner.errors.ConfigWarning")
def test_fsdp_x_tp_llama3_70b_on_256_gpus() -> None:
    """Llama 3 70B, FSDP 32 x TP 8, local batch 16, full AC: 597.3 tokens/s/GPU published;
    predicted within 10% (measured +3.7% under the torchtitan-compile stack's cuDNN attention; -0.6% with
    FlashAttention-2), and it fits the 96 GB it ran on."""
    # torchtitan asyncTP table @2887250b: 70B bf16 vanilla TP 597.3
    predicted, need = _per_gpu("llama3-70b", 256, 8192, 16, tp=8)
    assert predicted == pytest.approx(597.3, rel=0.10)
    assert need <= TORCHTITAN_HBM_BYTES


def test_fsdp_x_tp_llama3_8b_selective_checkpointing_is_bracketed() -> None:
    """Llama 3 8B, FSDP 8 x TP 8 on 64 GPUs, local batch 12, per-op selective AC (not modelled:
    it recomputes some ops of every block): 4,378 tokens/s/GPU published lies between the
    predictions with no checkpointing (+10%) and with every block checkpointed (-14%)."""
    # torchtitan asyncTP table @2887250b: 8B bf16 vanilla TP 4378
    none, _ = _per_gpu("llama3-8b", 64, 8192, 12, tp=8, checkpoint=False)
    full, need = _per_gpu("llama3-8b", 64, 8192, 12, tp=8, checkpoint=True)
    assert full < 4378 < none
    assert need <= TORCHTITAN_HBM_BYTES


# (cp, seq_len, published tokens/s per GPU): FSDP 8/cp x CP cp, each row 262,144 tokens per step
CP_ROWS = [(1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071), (8, 262144, 548)]


@pytest.fixture(scope="module")
def cp_predictions() -> dict[int, tuple[float, int]]:
    import warnings

    from planner.errors import ConfigWarning

    with warnings.catch_warnings():  # these contexts are beyond Llama 3's 8k: torchtitan ran them so
        warnings.simplefilter("ignore", ConfigWarning)
        # torch's CP dispatcher ran SDPA's flash or memory-efficient kernel (torchtitan restricts
        # it there): FlashAttention-2's curves
        return {cp: _per_gpu("llama3-8b", 8, seq, 1, cp=cp, kernel="flash2") for cp, seq, _ in CP_ROWS}


@pytest.mark.parametrize(("cp", "seq_len", "published"), CP_ROWS[:2])
def test_context_parallel_up_to_64k_tokens(cp: int, seq_len: int, published: float,
                                           cp_predictions: dict[int, tuple[float, int]]) -> None:
    """32k and 64k tokens (CP 1 and 2): within 15% (measured -9.7% and -10.3%: eager bf16 is
    slower than the compiled Float8 run), and the fall from 32k to 64k within 5% of torchtitan's."""
    predicted, need = cp_predictions[cp]
    assert predicted == pytest.approx(published, rel=0.15)
    assert need <= TORCHTITAN_HBM_BYTES
    ratio = predicted / cp_predictions[1][0]
    assert ratio == pytest.approx(published / CP_ROWS[0][2], rel=0.05)


@pytest.mark.parametrize(("cp", "seq_len", "published"), CP_ROWS[2:])
def test_context_parallel_beyond_64k_tokens_is_optimistic(cp: int, seq_len: int, published: float,
                                                           cp_predictions: dict[int, tuple[float, int]]) -> None:
    """128k and 256k tokens (CP 4 and 8): a known deviation, stated in the README and
    docs/validation.md: the published runs fall faster with context than the model (measured +25%
    and +34% optimistic; attention is most of these steps, where a 500 W power limit throttles
    hardest and compile and Float8 help least). Held here so that it is noticed if it grows."""
    predicted, need = cp_predictions[cp]
    assert 1.0 < predicted / published < 1.40
    assert need <= TORCHTITAN_HBM_BYTES
