"""Context parallelism: the planner's rank against PyTorch's own ring attention (torch's
``context_parallel`` on a fake process group under fake tensors, the CPU flash kernel run through
torch's ring templates: ``validate.context``), the refusals, and FLOPs that compare across layouts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.ops.attention import _ring_peaks
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.program.estimate import estimate
from validate.context import micro_batch_context, ring_attention_on_cpu
from validate.distributed import simulate_rank
from validate.tracker import LiveStorageTracker

HW = load_hardware("h100-sxm")
# big enough that FSDP2's ~10 KiB of host-side AdamW step scalars (tests/planner/test_fsdp_*) stay
# far below 1%; every knob below is exercised on it
MODEL = ModelConfig(family="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=704, vocab_size=512,
                    max_seq_len=2048)


def _ring(cp: int, dtype: torch.dtype, heads: int, kv_heads: int, batch: int, seq_len: int,
          head_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((forward peak, left after), (backward peak, left after)) of one SDPA call as ring attention
    on rank 0 of ``cp``, measured with the live-storage tracker; q, k, v are views of (B, T, X*H)
    projections as in the reference model."""
    local = seq_len // cp
    mesh = DeviceMesh("cpu", list(range(cp)))
    with FakeTensorMode(), ring_attention_on_cpu():
        q_proj, k_proj, v_proj, grad = (torch.randn(batch, local, n * head_dim, dtype=dtype, requires_grad=True)
                                        for n in (heads, kv_heads, kv_heads, heads))
        tracker = LiveStorageTracker()
        tracker.track([q_proj, k_proj, v_proj, grad])
        with tracker, micro_batch_context(mesh, seq_len, torch.device("cpu")):
            q, k, v = (rearrange(t, "b t (n h) -> b n t h", h=head_dim) for t in (q_proj, k_proj, v_proj))
            tracker.reset_peak()
            start = tracker.live_bytes
            out = rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads),
                            "b n t h -> b t (n h)")
            forward = (tracker.peak_bytes - start, tracker.live_bytes - start)
            tracker.reset_peak()
            start = tracker.live_bytes
            out.backward(grad.detach())
            backward = tracker.peak_bytes - start
    return forward, (backward, 0)


@pytest.fixture
def fake_group_of_8() -> object:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield None
    dist.destroy_process_group()


@pytest.mark.parametrize(("cp", "dtype", "heads", "kv_heads", "batch", "seq_len", "head_dim"), [
    (2, torch.float32, 4, 2, 1, 512, 16),
    (2, torch.bfloat16, 8, 2, 3, 1024, 32),
    (4, torch.float32, 4, 4, 1, 512, 32),
    (4, torch.bfloat16, 4, 2, 3, 512, 16),
    (8, torch.float32, 8, 2, 1, 1024, 16),
    (8, torch.bfloat16, 4, 4, 3, 1024, 32),
])
def test_the_ring_peaks_are_torchs(fake_group_of_8: object, cp: int, dtype: torch.dtype, heads: int, kv_heads: int,
                                   batch: int, seq_len: int, head_dim: int) -> None:
    """``_ring_peaks`` transcribes torch 2.13's ring attention on rank 0: forward and backward
    peaks equal the tracker's to the byte (these shapes round to whole 512-byte blocks)."""
    (fwd_peak, fwd_left), (bwd_peak, _) = _ring(cp, dtype, heads, kv_heads, batch, seq_len, head_dim)
    b = torch.finfo(dtype).bits // 8
    local = seq_len // cp
    u, w, lse = (batch * heads * local * head_dim * b, batch * kv_heads * local * head_dim * b,
                 batch * heads * local * 4)
    forward, backward = _ring_peaks(u, w, lse, cp, b < 4)
    assert (forward, backward) == (fwd_peak, bwd_peak)
    assert fwd_left == 2 * u + lse  # SDPA's merged output and lse, and the head merge (a copy)


LAYOUTS = [  # (cp, tp, ZeRO stage, precision, micro-batch, accumulation, checkpointed blocks)
    (2, 1, 3, "fp32", 1, 1, ()),
    (4, 1, 3, "fp32", 1, 1, ()),
    (2, 1, 3, "bf16-mixed", 2, 2, ()),
    (4, 1, 2, "bf16-true", 1, 2, (1,)),
    (2, 2, 2, "fp32", 1, 1, ()),
    (2, 2, 3, "bf16-mixed", 1, 1, (0, 1)),
]


@pytest.mark.parametrize(("cp", "tp", "stage", "precision", "micro", "accum", "checkpoint"), LAYOUTS)
def test_planner_matches_pytorch_per_rank(cp: int, tp: int, stage: int, precision: str, micro: int, accum: int,
                                          checkpoint: tuple[int, ...]) -> None:
    """Rank 0 of 4 x cp x tp ranks (FSDP2 over the data- and context-parallel ranks, TP with SP
    innermost) running the reference model's real step: within 1% of the tracker (measured here:
    within 0.12%)."""
    from roofplan import api

    training = TrainConfig(seq_len=1024, global_batch_size=4 * micro * accum)
    dims = ParallelDims.data_parallel_of(4 * cp * tp, stage, tp=tp, sp=tp > 1, cp=cp)
    knobs = Knobs(micro_batch_size=micro, grad_accum_steps=accum, precision=precision, parallel=dims,
                  checkpoint_blocks=checkpoint)
    plan = api.estimate_plan(MODEL, training, HW, knobs)
    report = simulate_rank(plan)
    measured = report.measured.peak_allocated_bytes
    predicted = plan.best.estimate.memory.peak_allocated_bytes
    assert predicted == pytest.approx(measured, rel=0.01), (predicted, measured)


def test_model_flops_do_not_depend_on_the_layout() -> None:
    """MFU compares across layouts: model FLOPs are the unsharded model's (FlopCounterMode's full
    T x T square); the ring executes 1/cp of the causal work on each rank."""
    training = TrainConfig(seq_len=4096, global_batch_size=8)
    one = estimate(MODEL, training, HW, Knobs(micro_batch_size=1, grad_accum_steps=1,
                                              parallel=ParallelDims.data_parallel_of(8, 3)))
    ring = estimate(MODEL, training, HW, Knobs(micro_batch_size=1, grad_accum_steps=1,
                                               parallel=ParallelDims.data_parallel_of(32, 3, cp=4)))
    assert ring.model_flops_per_step == pytest.approx(one.model_flops_per_step, rel=1e-12)
    core = next(op for op in ring.ops if op.name == "blocks.0.attn.core")
    flat = next(op for op in one.ops if op.name == "blocks.0.attn.core")
    assert core.fwd_flops == pytest.approx(flat.fwd_flops / 4, rel=1e-12)


def test_the_ring_hides_its_gather_behind_the_diagonal_block() -> None:
    """The ring's collectives are on the critical path only beyond the block each overlaps: long
    sequences on one node hide them; the time table shows what is left as context parallelism."""
    training = TrainConfig(seq_len=32768, global_batch_size=8)
    big = ModelConfig(family="llama", n_layers=4, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                      vocab_size=128256, max_seq_len=32768)
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=1, checkpoint_blocks=(0, 1, 2, 3),
                  parallel=ParallelDims.data_parallel_of(64, 3, cp=8))
    inside = estimate(big, training, HW.with_gpus_per_node(8), knobs)
    across = estimate(big, training, HW.with_gpus_per_node(4), knobs)  # the ring crosses two nodes
    assert 0 <= inside.time.context_parallel_s < across.time.context_parallel_s
    assert across.step_time_s > inside.step_time_s


@pytest.mark.parametrize(("model", "seq_len", "needle"), [
    (MODEL.model_copy(update={"attention": "eager"}), 1024, "eager attention"),
    (ModelConfig(family="gpt2", n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=512, max_seq_len=1024),
     1024, "learned positions"),
    (MODEL, 1020, "2 x cp = 8 equal chunks"),
])
def test_layouts_torch_cannot_run_are_refused(model: ModelConfig, seq_len: int, needle: str) -> None:
    training = TrainConfig(seq_len=seq_len, global_batch_size=8)
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=1, parallel=ParallelDims.data_parallel_of(32, 3, cp=4))
    with pytest.raises(ConfigError, match=needle):
        estimate(model, training, HW, knobs)


def test_ddp_beside_context_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="parallel.cp: context parallelism runs with FSDP2"):
        ParallelDims.data_parallel_of(8, 0, cp=2)
