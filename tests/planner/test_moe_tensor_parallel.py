"""Tensor parallelism of mixture-of-experts blocks (``planner.parallel.tensor_moe``,
``validate.moe_parallel``): a rank's peak against the live-storage tracker on rank 0 of a fake
process group (TP 2 with and without SP, TP 2 x EP 2 with FSDP2), what one rank holds and runs,
the collectives, and the refusals."""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.parallel.tensor import rank_parameters
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.program.estimate import check_knobs, estimate, rank_graph

HW = load_hardware("h100-sxm")
BASE = dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=512)
MIXTRAL = ModelConfig(family="mixtral", **BASE, moe=dict(n_experts=4, top_k=2, d_ff_expert=192))
QWEN2_MOE = ModelConfig(family="qwen2_moe", **BASE, moe=dict(n_experts=8, top_k=2, d_ff_expert=96, shared_d_ff=160,
                                                             shared_gate=True, norm_topk_prob=False))
MODELS = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}

# (model, precision, layout, checkpointed blocks, accumulation); measured here: within 0.2%
CASES = [
    ("mixtral", "fp32", ParallelDims(tp=2), (), 1),
    ("mixtral", "bf16-true", ParallelDims(tp=2, sp=True), (1,), 1),  # the exit's gathered gradient dies early
    ("qwen2_moe", "bf16-mixed", ParallelDims(tp=2), (1,), 2),  # uncached casts; the gate stops the recompute
    ("mixtral", "bf16-mixed", ParallelDims.data_parallel_of(4, 3, tp=2, sp=True, ep=2), (0,), 1),  # ZeRO-3
    ("qwen2_moe", "fp32", ParallelDims.data_parallel_of(4, 2, tp=2, ep=2), (), 2),  # ZeRO-2
]


@pytest.mark.parametrize(("name", "precision", "layout", "blocks", "accum"), CASES,
                         ids=["tp2-fp32", "tp2-sp-bf16-ckpt", "tp2-shared-bf16mixed-ckpt-acc",
                              "zero3-tp2-sp-ep2-ckpt", "zero2-tp2-ep2-shared-acc"])
def test_rank_peak_matches_pytorch_on_a_fake_process_group(name: str, precision: str, layout: ParallelDims,
                                                           blocks: tuple[int, ...], accum: int) -> None:
    """The reference MoE under ``validate.moe_parallel`` (DTensor weights, local compute) on rank
    0 of a fake process group, measured by the live-storage tracker: the planner within 1%."""
    pytest.importorskip("torch")
    from roofplan import api

    training = TrainConfig(seq_len=128, global_batch_size=2 * accum * layout.data_parallel, optimizer_impl="fused")
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accum, precision=precision, parallel=layout,
                  checkpoint_blocks=blocks)
    report = api.validate(api.estimate_plan(MODELS[name], training, "h100-sxm", knobs), mode="simulate")
    assert abs(report.errors["peak_allocated"]) <= 0.01, report.errors
    assert report.passed


def _graph(model: ModelConfig, layout: ParallelDims, training: TrainConfig):  # type: ignore[no-untyped-def]
    knobs = Knobs(micro_batch_size=2, parallel=layout)
    return rank_graph(model, training, knobs, check_knobs(model, training, HW, knobs), HW)


def test_a_rank_holds_and_runs_its_share_of_the_experts() -> None:
    """Per tensor-parallel rank: I/tp of every expert (and of the shared experts), the router whole;
    the experts' matmul FLOPs 1/tp of the unsharded model's, the model's FLOPs per step unchanged
    (the router, run on every rank, counted once)."""
    training = TrainConfig(seq_len=128, global_batch_size=2)
    whole, split = (_graph(QWEN2_MOE, layout, training) for layout in (ParallelDims(), ParallelDims(tp=2, sp=True)))

    def params(graph, part: str) -> int:  # type: ignore[no-untyped-def]
        return sum(n for name, n in graph.param_tensors.items() if part in name)

    def flops(graph, part: str) -> float:  # type: ignore[no-untyped-def]
        return sum(op.cost.fwd_flops + op.cost.bwd_flops for op in graph.nodes if part in op.spec.name)

    for part in (".experts.", ".shared_expert."):
        assert params(whole, part) == 2 * params(split, part)
        assert flops(whole, part) == 2 * flops(split, part)
    for part in (".router.", ".shared_gate."):
        assert params(whole, part) == params(split, part) > 0
    knobs = [Knobs(micro_batch_size=2, parallel=layout) for layout in (ParallelDims(), ParallelDims(tp=2))]
    runs = [estimate(QWEN2_MOE, training, HW, k) for k in knobs]
    assert runs[0].model_flops_per_step == pytest.approx(runs[1].model_flops_per_step, rel=1e-12)
    assert runs[1].hardware_flops_per_step > runs[1].model_flops_per_step  # the router twice


@pytest.mark.parametrize("sp", [True, False])
def test_one_collective_in_and_one_out_per_moe_block(sp: bool) -> None:
    """Each MoE block: an all-gather in (SP; none without) and a reduce-scatter (SP) or all-reduce
    out in the forward, the gradient's reduce-scatter (SP) or all-reduce at the entry in the
    backward; the router's weight gradient all-reduced."""
    training = TrainConfig(seq_len=128, global_batch_size=2)
    graph = _graph(MIXTRAL, ParallelDims(tp=2, sp=sp), training)
    tokens, d = 2 * 128, MIXTRAL.d_model
    entry, exit_ = graph.node("blocks.0.mlp.tp_in").cost, graph.node("blocks.0.mlp.tp_out").cost
    assert [c.kind.value for c in entry.fwd_collectives] == (["all_gather"] if sp else [])
    assert [c.kind.value for c in entry.bwd_collectives] == ["reduce_scatter" if sp else "all_reduce"]
    assert [(c.kind.value, c.n_bytes) for c in exit_.fwd_collectives] == [
        ("reduce_scatter" if sp else "all_reduce", tokens * d * 2)]  # bf16 activations
    router = graph.node("blocks.0.mlp.router").cost
    assert [(c.kind.value, c.n_bytes) for c in router.bwd_collectives] == [("all_reduce", 4 * d * 4)]  # fp32 gradient
    inside = [op.spec.name for op in graph.nodes if op.spec.name.startswith("blocks.0.mlp.")
              and (op.cost.fwd_collectives or op.cost.bwd_collectives)]
    assert inside == ["blocks.0.mlp.tp_in", "blocks.0.mlp.router", "blocks.0.mlp.tp_out"]
    assert estimate(MIXTRAL, training, HW, Knobs(micro_batch_size=2, parallel=ParallelDims(tp=2, sp=sp))) \
        .time.tensor_parallel_s > 0


def test_refusals_name_the_field() -> None:
    training = TrainConfig(seq_len=128, global_batch_size=2)
    knobs = Knobs(micro_batch_size=2, parallel=ParallelDims(tp=2, sp=True))
    aux = MIXTRAL.model_copy(update={"moe": MIXTRAL.moe.model_copy(update={"aux_loss_coef": 0.01})})  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="moe.aux_loss_coef: under tensor parallelism"):
        estimate(aux, training, HW, knobs)
    odd = MIXTRAL.model_copy(update={"moe": MIXTRAL.moe.model_copy(update={"d_ff_expert": 191})})  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="parallel.tp: 2 does not divide moe.d_ff_expert 191"):
        estimate(odd, training, HW, knobs)


@pytest.mark.parametrize("layout", [ParallelDims(tp=2, sp=True), ParallelDims.data_parallel_of(4, 3, tp=2, ep=2)])
def test_rank_parameters_equal_the_local_shards_pytorch_holds(layout: ParallelDims) -> None:
    """``rank_parameters`` (before FSDP2) against the local shards of the reference model after
    ``validate.layout``'s tensor parallelism (and E/ep experts) on a fake process group."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    from validate.distributed import fake_process_group
    from validate.parallelize import apply_tensor_parallel, meshes_outside_fake_mode
    from validate.reference_model import build_model

    knobs = Knobs(micro_batch_size=2, parallel=layout)
    with fake_process_group(layout) as mesh, FakeTensorMode(), meshes_outside_fake_mode():
        net = apply_tensor_parallel(build_model(QWEN2_MOE, torch.float32, layout.ep), knobs, mesh["tp"])
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in net.parameters())
    assert local == rank_parameters(QWEN2_MOE, layout)
