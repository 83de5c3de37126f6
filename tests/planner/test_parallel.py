"""Several GPUs: ZeRO's per-rank model-state formulas, PyTorch's own partitions and shards, the
ring model, and the per-rank memory the planner reports for DDP and ZeRO-1."""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.parallel.collectives import (
    Collective,
    ParallelConfig,
    fsdp_shard_numel,
    model_state_bytes,
    ring_time_s,
    zero1_partition,
)
from planner.plan.knobs import Knobs
from planner.precision import precision_spec
from planner.program.estimate import cached_graph, estimate, static_for
from roofplan import api

GB = 1e9


@pytest.mark.parametrize(("stage", "expected_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage: int, expected_gb: float) -> None:
    # Rajbhandari et al. 2019, Fig. 1: Ψ = 7.5B, N_d = 64, K = 12 (fp16 params 2 + grads 2 + fp32
    # Adam states 12 bytes): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device, printed to one decimal
    assert model_state_bytes(7.5e9, 64, stage, 2, 2, 12) / GB == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize(("stage", "world"), [(0, 8), (1, 8), (1, 64)])
def test_per_rank_model_state_matches_zero_formula(precision: str, stage: int, world: int) -> None:
    """Stages 0 and 1 as PyTorch runs them (DDP buckets; ZeroRedundancyOptimizer's whole-tensor
    partition) vs ZeRO's closed form under this precision's bytes per parameter. The partition's
    granularity (the largest tensor, the 131M-element embedding) bounds the difference."""
    model, training = api.load_model("llama2-7b", global_batch_size=world)
    hw = load_hardware("h100-sxm")
    knobs = Knobs(micro_batch_size=1, precision=precision, data_parallel=world, zero_stage=stage)
    spec = precision_spec(precision)
    static = static_for(cached_graph(model, 1, training.seq_len, spec), hw, training, knobs)
    ours = static.params_bytes + static.grads_bytes + static.optimizer_bytes
    closed = model_state_bytes(6_738_415_616, world, stage, spec.param_bytes, spec.grad_bytes, 2 * spec.param_bytes)
    assert ours == pytest.approx(closed, rel=0.02 if world == 64 else 0.005)
    assert static.grads_resident  # DDP's buckets hold the gradients for the whole step


def test_partition_is_torchs() -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, _ = api.load_model("tiny-llama")
    graph = cached_graph(model, 1, 32, precision_spec("fp32"))
    specs = list(graph.param_specs.values())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        from validate.reference_model import build_model

        net = build_model(model)
        by_name = dict(net.named_parameters())
        params = [by_name[p.name] for p in specs]  # the planner's order is the module order
        zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW)
        theirs = [sorted(p.numel() for group in rank for p in group["params"]) for rank in zero._partition_parameters()]
    finally:
        dist.destroy_process_group()
    ours = [sorted(p.numel for p in rank) for rank in zero1_partition(specs, 4)]
    assert ours == theirs


@pytest.mark.parametrize("world", [2, 8, 64])
def test_fsdp2_shard_sizes_are_torchs(world: int) -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from validate.reference_model import build_model

    model, _ = api.load_model("tiny-gpt2")
    specs = cached_graph(model, 1, 32, precision_spec("fp32")).param_specs
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with FakeTensorMode():
            net = build_model(model)
            for block in net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)
            local = {name: p._local_tensor.untyped_storage().nbytes() // 4 for name, p in net.named_parameters()}
    finally:
        dist.destroy_process_group()
    for name, numel in local.items():
        assert fsdp_shard_numel(specs[name], world) == numel, name


def test_ring_model() -> None:
    """NCCL's ring: 2(N-1)/N (all-reduce) or (N-1)/N of the bytes over the bus bandwidth, plus
    NCCL's latency per step (tuning.cc, ring/Simple: 8.4 µs base, 3.4 µs per NVLink step). The
    algebra on a profile without published size ramps; with them the bytes run at the ramp's share
    of the bus bandwidth (tests/hardware/test_collectives.py)."""
    measured = load_hardware("h100-sxm")
    hw = measured.model_copy(update={"collective_ramps": ()})
    one_node = ParallelConfig(world_size=8)
    two_nodes = ParallelConfig(world_size=16, gpus_per_node=8)
    gb = 1e9
    nvlink = 450e9 * hw.collective_efficiency
    assert ring_time_s(gb, Collective.ALL_REDUCE, hw, one_node) == pytest.approx(
        2 * 7 / 8 * gb / nvlink + 8.4e-6 + 14 * 3.4e-6)
    assert ring_time_s(gb, Collective.ALL_GATHER, hw, one_node) == pytest.approx(7 / 8 * gb / nvlink + 8.4e-6 + 7 * 3.4e-6)
    # across nodes a ring runs over all 8 NICs of a node (8 x 50 GB/s), not one GPU's NIC
    network = 8 * 50e9 * hw.network_efficiency
    assert ring_time_s(gb, Collective.REDUCE_SCATTER, hw, two_nodes) == pytest.approx(
        15 / 16 * gb / min(network, nvlink) + 8.4e-6 + 14 * 3.4e-6 + 1 * 14e-6)
    assert ring_time_s(gb, Collective.ALL_REDUCE, hw, ParallelConfig(world_size=1)) == 0.0
    assert ring_time_s(gb, Collective.ALL_REDUCE, measured, one_node) > ring_time_s(gb, Collective.ALL_REDUCE, hw,
                                                                                    one_node)


def test_data_parallel_step() -> None:
    """More GPUs: the same per-rank memory under DDP, less under ZeRO-1, a shorter step, the
    same model FLOPs per step in total, and communication that grows across nodes."""
    model, training = api.load_model("llama2-7b", global_batch_size=64)
    hw = load_hardware("h100-sxm")

    def run(world: int, stage: int, per_node: int = 8):  # noqa: ANN202
        knobs = Knobs(micro_batch_size=1, grad_accum_steps=64 // world, precision="bf16-mixed", data_parallel=world,
                      zero_stage=stage, checkpoint_blocks=range(32))
        return estimate(model, training, hw.with_gpus_per_node(per_node), knobs)

    single, ddp, zero1 = run(1, 0), run(8, 0), run(8, 1)
    assert ddp.memory.params_bytes == single.memory.params_bytes
    assert zero1.memory.optimizer_bytes < ddp.memory.optimizer_bytes / 6
    assert zero1.memory.peak_allocated_bytes < ddp.memory.peak_allocated_bytes
    assert ddp.model_flops_per_step == pytest.approx(single.model_flops_per_step)
    assert ddp.step_time_s < single.step_time_s / 6
    one_node, two_nodes = run(16, 1, per_node=16), run(16, 1, per_node=8)
    assert two_nodes.time.communication_s > one_node.time.communication_s > 0
    assert two_nodes.mfu < one_node.mfu
