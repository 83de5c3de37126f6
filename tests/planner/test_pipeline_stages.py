"""A model split into pipeline stages (``planner.graph.stages``): each stage's graph is cut from
the whole model's, so together the stages run every op once (the rotary tables and masks, which
the model's forward computes for its blocks, on every stage), hold every parameter (a tied
embedding on both ends), and count the model's FLOPs."""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.graph.stages import STAGE_INPUT, StageSpan, even_spans, spans_of, stage_graph
from planner.memory.step import checkpoint_units, simulate_step
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.plan.schedule import accumulation
from planner.program.estimate import check_knobs, rank_graph, static_for

HW = load_hardware("h100-sxm")
MODELS = {
    "llama": ModelConfig(family="llama", n_layers=6, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512),
    "gpt2-tied": ModelConfig(family="gpt2", n_layers=5, d_model=64, n_heads=2, d_ff=256, vocab_size=512,
                             max_seq_len=64, attention="eager"),
    "moe": ModelConfig(family="mixtral", n_layers=5, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                       moe={"n_experts": 4, "top_k": 2, "d_ff_expert": 64, "first_dense_layers": 2}),
}


def _graph(model: ModelConfig, precision: str = "bf16-mixed"):  # noqa: ANN202
    training = TrainConfig(seq_len=64, global_batch_size=4)
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=2, precision=precision)
    return training, knobs, rank_graph(model, training, knobs, check_knobs(model, training, HW, knobs), HW)


def test_even_spans_put_the_extra_blocks_first() -> None:
    assert even_spans(10, 4) == (StageSpan(0, 2), StageSpan(3, 5), StageSpan(6, 7), StageSpan(8, 9))
    assert spans_of((3, 3, 2, 2)) == even_spans(10, 4)
    with pytest.raises(ValueError, match="at least one block"):
        even_spans(3, 4)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("n_stages", [2, 3, 5])
def test_the_stages_run_every_op_once_and_hold_every_parameter(name: str, n_stages: int) -> None:
    model = MODELS[name]
    _, _, whole = _graph(model)
    stages = [stage_graph(whole, span) for span in even_spans(model.n_layers, n_stages)]
    shared = {"rope", "causal_mask", "window_mask"} & set(whole.order)
    seen: dict[str, int] = {}
    for stage in stages:
        for op in stage.order:
            seen[op] = seen.get(op, 0) + 1
    assert seen.pop(STAGE_INPUT) == n_stages - 1
    assert seen == {op: (n_stages if op in shared else 1) for op in whole.order}
    fwd = sum(n.cost.fwd_flops + n.cost.bwd_flops for n in whole.nodes)
    assert sum(n.cost.fwd_flops + n.cost.bwd_flops for s in stages for n in s.nodes) == pytest.approx(fwd, rel=1e-12)
    tied = model.vocab_size * model.d_model if model.tie_embeddings else 0
    assert sum(s.n_params for s in stages) == whole.n_params + tied


def test_a_later_stage_starts_from_the_received_activation() -> None:
    """The stage input is the boundary tensor (the previous block's residual output), held
    as the first block's saved input, and the last op of an earlier stage is its last block's output."""
    model = MODELS["llama"]
    _, _, whole = _graph(model)
    first, second = (stage_graph(whole, span) for span in even_spans(model.n_layers, 2))
    assert first.order[-1] == "blocks.2.mlp_residual" and "lm_head" not in first.order
    received = second.node(STAGE_INPUT)
    assert received.cost.output == whole.node("blocks.2.mlp_residual").cost.output
    assert second.saved[STAGE_INPUT] == received.cost.output.n_bytes  # the first block's norm saves it
    assert "embed" not in second.order and second.order[-1] == "loss"
    assert [c for p, c, _, _ in second.edges if p == STAGE_INPUT] == ["blocks.3.attn_norm", "blocks.3.attn_residual"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_middle_stage_walk_receives_its_output_gradient(precision: str) -> None:
    """A stage before the last walks its backward from the received gradient of its output (no
    loss), holding no logits."""
    model = MODELS["llama"]
    training, knobs, whole = _graph(model, precision)
    spans = even_spans(model.n_layers, 3)
    middle = stage_graph(whole, spans[1])
    timeline = simulate_step(middle, static_for(middle, HW, training, knobs), HW.round_alloc,
                             checkpoint_units(model.n_layers, ()), accumulation(1), record_trace=True)
    assert timeline.logits_bytes == 0
    backward = [e for e in timeline.trace if e.phase.value == "backward"]
    assert backward and all(e.micro_batch == 0 for e in backward)
    assert timeline.trace[-1].live_bytes >= static_for(middle, HW, training, knobs).params_bytes
