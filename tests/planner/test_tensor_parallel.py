"""Tensor and sequence parallelism in the planner: the rank's shard of the model, the collectives
in its graph, what is refused, and Korthikanti et al. 2022's Table 2 (arXiv:2205.05198).

Memory against PyTorch itself (DTensor on a fake process group) is in
tests/validate/test_tensor_parallel_memory.py.
"""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.graph.blocks import describe
from planner.graph.description import TpRole
from planner.graph.params import count_params
from planner.model.config import ModelConfig, TrainConfig
from planner.model.sources import load_preset
from planner.ops.base import OpKind
from planner.parallel.tensor import shard_tensor_parallel
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.program.estimate import check_knobs, estimate, peak_lower_bound, rank_graph

HW = load_hardware("h100-sxm")
LLAMA2_7B = load_preset("llama2-7b").model


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_rank_holds_one_tp_th_of_every_split_tensor(tp: int) -> None:
    """Colwise and rowwise weights, the embedding and the LM head are split t ways; norms are
    whole on every rank (Llama 2 7B: 6,738,415,616 parameters, 65 norms of 4096)."""
    full = describe(LLAMA2_7B).params
    rank = shard_tensor_parallel(describe(LLAMA2_7B), LLAMA2_7B, tp, True, tp).params
    assert rank.keys() == full.keys()
    whole = sum(p.numel for name, p in full.items() if "norm" in name)
    assert whole == 65 * 4096
    assert sum(p.numel for p in rank.values()) == (count_params(LLAMA2_7B) - whole) // tp + whole
    assert rank["blocks.0.attn.q_proj.weight"].rows == 4096 // tp  # ColwiseParallel: Shard(0)
    assert rank["blocks.0.attn.o_proj.weight"].rows == 4096  # RowwiseParallel: Shard(1), every row
    assert rank["embed.weight"].grad_elements == full["embed.weight"].numel  # a whole, replicated gradient


def test_the_rank_graph_runs_the_styles_collectives() -> None:
    training = TrainConfig(seq_len=4096, global_batch_size=8)
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, parallel=ParallelDims(tp=8, sp=True))
    graph = rank_graph(LLAMA2_7B, training, knobs, check_knobs(LLAMA2_7B, training, HW, knobs), HW)
    kinds = [graph.node(n).spec.kind for n in graph.order]
    # per block: a gather before attention and before the MLP, a reduce-scatter after each
    assert kinds.count(OpKind.GATHER_FROM_SEQUENCE) == 2 * 32 + 1  # + the LM head's input
    assert kinds.count(OpKind.REDUCE_SCATTER_TO_SEQUENCE) == 2 * 32 + 1  # + the embedding's output
    core = graph.node("blocks.0.attn.core").spec
    assert (core.n_heads, core.n_kv_heads) == (4, 4)
    gather = graph.node("blocks.0.attn.tp_in").cost
    assert len(gather.fwd_collectives) == 1 and gather.fwd_collectives[0].group_size == 8
    # the gathered (B, T, D) activation: 4096 x 4096 x fp32 (the residual stream under autocast)
    assert gather.fwd_collectives[0].n_bytes == 4096 * 4096 * 4
    without_sp = rank_graph(LLAMA2_7B, training, knobs.model_copy(update={"parallel": ParallelDims(tp=8)}),
                            check_knobs(LLAMA2_7B, training, HW, knobs), HW)
    enter = without_sp.node("blocks.0.attn.tp_in").cost
    assert enter.output_is_view and not enter.fwd_collectives and len(enter.bwd_collectives) == 1


def test_collectives_are_on_the_critical_path() -> None:
    """TP's all-reduces add to the step: the same work with tp 8 takes longer per rank than an
    eighth of one GPU's, by about the collectives' time."""
    training = TrainConfig(seq_len=4096, global_batch_size=8)
    one = estimate(LLAMA2_7B, training, HW, Knobs(micro_batch_size=1, grad_accum_steps=8))
    tp = estimate(LLAMA2_7B, training, HW, Knobs(micro_batch_size=1, grad_accum_steps=8,
                                                 parallel=ParallelDims(tp=8, sp=True)))
    comm = sum(g.time_s for g in tp.op_groups if g.bound.value == "communication")
    assert comm > 0
    assert tp.step_time_s > one.step_time_s / 8 + 0.9 * comm
    assert {g.name for g in tp.op_groups if g.bound.value == "communication"} >= {"attn.tp_in", "mlp.down_proj.tp_out"}


@pytest.mark.parametrize(("model", "layout", "field"), [
    (LLAMA2_7B, ParallelDims(tp=3), "parallel.tp"),  # 32 heads
    (load_preset("llama3-8b").model, ParallelDims(tp=16), "parallel.tp"),  # 8 kv heads: not replicated
    (load_preset("gpt2").model, ParallelDims(tp=2), "tie_embeddings"),  # parallelize_module unties them
])
def test_layouts_torch_cannot_run_as_planned_are_refused(model: ModelConfig, layout: ParallelDims, field: str) -> None:
    training = TrainConfig(seq_len=1024, global_batch_size=8)
    with pytest.raises(ConfigError, match=field):
        estimate(model, training, HW, Knobs(micro_batch_size=1, grad_accum_steps=8, parallel=layout))


def test_sequence_parallelism_needs_a_tensor_parallel_group() -> None:
    with pytest.raises(ValueError, match="parallel.sp"):
        ParallelDims(sp=True)


def test_the_lower_bound_holds_under_tensor_parallelism() -> None:
    training = TrainConfig(seq_len=2048, global_batch_size=8)
    for layout in (ParallelDims(tp=2), ParallelDims(tp=4, sp=True)):
        knobs = Knobs(micro_batch_size=2, grad_accum_steps=4, parallel=layout, checkpoint_blocks=tuple(range(32)))
        peak = estimate(LLAMA2_7B, training, HW, knobs).memory.peak_allocated_bytes
        assert peak_lower_bound(LLAMA2_7B, training, HW, knobs) <= peak


# --- Korthikanti et al. 2022, Table 2 (16-bit activations, dropout, eager attention) ----------------

S, B, H, A = 2048, 1, 2048, 16


def _per_layer_bytes(tp: int, sp: bool) -> float:
    """Activation bytes one more block adds, on one rank (bf16-true: 16-bit everything)."""
    training = TrainConfig(seq_len=S, global_batch_size=B)

    def saved(n_layers: int) -> int:
        model = ModelConfig(family="gpt2", n_layers=n_layers, d_model=H, n_heads=A, d_ff=4 * H, vocab_size=50304,
                            max_seq_len=S, attention="eager", dropout=0.1, tie_embeddings=False)
        knobs = Knobs(micro_batch_size=B, precision="bf16-true", parallel=ParallelDims(tp=tp, sp=sp))
        return estimate(model, training, HW, knobs).memory.activations_bytes

    return saved(3) - saved(2)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_parallel_row(t: int) -> None:
    # Table 2, "tensor parallel (baseline)": sbh(10 + 24/t + 5as/(ht)); LayerNorm statistics aside (0.5%)
    assert _per_layer_bytes(t, False) == pytest.approx(S * B * H * (10 + 24 / t + 5 * A * S / (H * t)), rel=0.005)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_sequence_parallel_row(t: int) -> None:
    """Table 2, "tensor + sequence parallel": sbh(34/t + 5as/(ht)). DTensor's colwise linears
    save the all-gathered input of attention and of the MLP, 2sbh each, where Megatron-LM saves
    the sequence shard and gathers it again in the backward: 4sbh(1 - 1/t) more, exactly."""
    korthikanti = S * B * H * (34 / t + 5 * A * S / (H * t))
    gathered_inputs = 2 * (2 * S * B * H) * (1 - 1 / t)
    assert _per_layer_bytes(t, True) == pytest.approx(korthikanti + gathered_inputs, rel=0.005)


def test_roles_cover_every_op_of_the_description() -> None:
    assert {op.tp for op in describe(LLAMA2_7B).ops} <= set(TpRole)
