"""Tensor parallelism against PyTorch itself: the reference model under ``parallelize_module``
(DTensor) on rank 0 of a fake process group, measured by the live-storage tracker, against the
planner's per-rank peak (issue: within 1%). ``validate --mode simulate`` runs these layouts the
same way, so each case goes through it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from planner.model.config import ModelConfig, TrainConfig  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.plan.parallel_dims import ParallelDims  # noqa: E402
from roofplan import api  # noqa: E402

LLAMA = ModelConfig(family="llama", n_layers=3, d_model=256, n_heads=8, n_kv_heads=4, d_ff=512, vocab_size=512)
GPT = ModelConfig(family="gpt2", n_layers=2, d_model=128, n_heads=4, d_ff=512, vocab_size=512, max_seq_len=128,
                  attention="eager", dropout=0.1, tie_embeddings=False)

CASES = [  # model, precision, layout, checkpointed blocks, accumulation
    (LLAMA, "bf16-mixed", ParallelDims(tp=2), (0,), 3),
    (LLAMA, "fp32", ParallelDims(tp=4, sp=True), (), 1),
    (GPT, "bf16-true", ParallelDims(tp=2, sp=True), (0, 1), 1),
    (LLAMA, "bf16-mixed", ParallelDims.data_parallel_of(4, 3, tp=2, sp=True), (), 1),  # FSDP2 ZeRO-3 x TP
    (LLAMA, "fp32", ParallelDims.data_parallel_of(4, 2, tp=2), (1,), 3),  # FSDP2 ZeRO-2 x TP, no SP
]


@pytest.mark.parametrize(("model", "precision", "layout", "blocks", "accum"), CASES,
                         ids=["tp2", "tp4-sp", "gpt-eager-dropout-sp", "fsdp3-x-tp2-sp", "fsdp2-x-tp2"])
def test_rank_peak_matches_dtensor_on_a_fake_process_group(model: ModelConfig, precision: str, layout: ParallelDims,
                                                           blocks: tuple[int, ...], accum: int) -> None:
    training = TrainConfig(seq_len=128, global_batch_size=2 * accum * layout.data_parallel, optimizer_impl="fused")
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accum, precision=precision, parallel=layout,
                  checkpoint_blocks=blocks)
    plan = api.estimate_plan(model, training, "h100-sxm", knobs)
    report = api.validate(plan, mode="simulate")
    assert abs(report.errors["peak_allocated"]) <= 0.01, report.errors
    assert report.passed
    assert "fake process group" in report.notes[0] and "TP" in report.notes[0]


def test_pytorch_keeps_the_gathered_inputs_under_sequence_parallelism() -> None:
    """Korthikanti et al. 2022 (Table 2) count sbh(34/t + 5as/(ht)) bytes per layer with sequence
    parallelism; DTensor's colwise linears keep the all-gathered inputs of attention and the MLP
    (Megatron-LM gathers them again in the backward): 4sbh(1 - 1/t) more. Measured on PyTorch's
    own forward, independent of the planner."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from validate.parallelize import apply_tensor_parallel, loss_context
    from validate.reference_model import build_model
    from validate.tracker import LiveStorageTracker

    s, b, h, a, t = 256, 2, 256, 8, 4
    knobs = Knobs(micro_batch_size=b, parallel=ParallelDims(tp=t, sp=True))

    def saved_after_forward(n_layers: int) -> int:
        config = ModelConfig(family="gpt2", n_layers=n_layers, d_model=h, n_heads=a, d_ff=4 * h, vocab_size=1024,
                             max_seq_len=s, attention="eager", dropout=0.1, tie_embeddings=False)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)
        try:
            mesh = init_device_mesh("cpu", (t,))
            with FakeTensorMode():
                model = apply_tensor_parallel(build_model(config, torch.bfloat16), knobs, mesh)
                ids = torch.randint(0, 1024, (b, s))
                tracker = LiveStorageTracker()
                tracker.track([*model.parameters(), ids])
                with tracker, loss_context(knobs):
                    before = tracker.live_bytes
                    loss = model(ids, ids)
                    after = tracker.live_bytes
                del loss
        finally:
            dist.destroy_process_group()
        return after - before

    per_layer = saved_after_forward(3) - saved_after_forward(2)
    sbh = s * b * h
    assert per_layer == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)) + 4 * sbh * (1 - 1 / t), rel=0.005)
