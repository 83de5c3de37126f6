"""The one model description (planner.graph.blocks) against the reference model PyTorch runs: the
same parameters in the same registration order (ZeroRedundancyOptimizer and FSDP2 partition by
that order), modules named as the graph's nodes, and the graph built from the description."""

from __future__ import annotations

import pytest
import torch

from planner.graph.blocks import describe
from planner.graph.description import TpRole
from planner.graph.layer_graph import build_graph
from planner.graph.params import param_tensors
from planner.model.config import AttentionImpl, ModelConfig
from planner.model.sources import load_preset
from planner.precision import PrecisionPolicy, precision_spec
from validate.reference_model import build_model

CASES = [
    load_preset("tiny-llama").model,
    load_preset("tiny-gpt2").model,
    load_preset("tiny-gpt2").model.model_copy(update={"dropout": 0.1, "attention": AttentionImpl.EAGER}),
    ModelConfig(family="qwen2", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=300,
                tie_embeddings=True),
]


@pytest.mark.parametrize("model", CASES, ids=lambda m: f"{m.name}-{m.attention.value}-{m.dropout}")
def test_parameters_in_registration_order(model: ModelConfig) -> None:
    with torch.device("meta"):
        net = build_model(model)
    assert list(param_tensors(model).items()) == [(name, p.numel()) for name, p in net.named_parameters()]


@pytest.mark.parametrize("model", CASES, ids=lambda m: f"{m.name}-{m.attention.value}-{m.dropout}")
def test_every_parametrized_op_is_a_module(model: ModelConfig) -> None:
    with torch.device("meta"):
        net = build_model(model)
    modules = dict(net.named_modules())
    for op in describe(model).ops:
        if op.params and op.field("owns_params", True):
            assert op.name in modules, op.name


def test_the_graph_is_the_description() -> None:
    model = CASES[0]
    desc = describe(model)
    graph = build_graph(model, 2, 32, precision_spec(PrecisionPolicy.BF16_MIXED))
    assert [n for n in graph.order if n != "logits_cast"] == [op.name for op in desc.ops]
    assert "logits_cast" in graph.order  # bf16 logits are cast up before the loss
    assert graph.held_until == dict(desc.held_until)
    fp32 = build_graph(model, 2, 32, precision_spec(PrecisionPolicy.FP32))
    assert "logits_cast" not in fp32.order


def test_tensor_parallel_roles() -> None:
    roles = {op.name.split(".", 2)[-1]: op.tp for op in describe(CASES[0]).ops if op.block == 0}
    assert roles["attn.q_proj"] is roles["mlp.up_proj"] is TpRole.COLWISE
    assert roles["attn.o_proj"] is roles["mlp.down_proj"] is TpRole.ROWWISE
    assert roles["attn.core"] is TpRole.HEADS
    assert roles["attn_norm"] is roles["attn_residual"] is TpRole.SEQUENCE
