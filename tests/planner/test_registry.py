"""Contract suite over every cost formula and the structure of every built layer graph."""

from __future__ import annotations

import importlib
import inspect
from functools import cache
from types import ModuleType

import networkx as nx
import pytest
import torch

from planner.graph.layer_graph import LayerGraph, build_graph
from planner.graph.params import count_params
from planner.model.config import AttentionImpl, ModelConfig
from planner.model.sources import load_preset
from planner.ops import catalog, registry
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind
from planner.precision import PrecisionPolicy, precision_spec
from validate.reference_model import build_model

FORMULA_MODULES = ("attention", "collectives", "elementwise", "embedding", "gemma", "linear", "llama4", "loss", "mla", "moe",
                   "norm", "rotary", "scale", "pipeline")

# Graph nodes of these kinds are modules of the reference model, named as torch names them.
MODULE_KINDS = frozenset({
    OpKind.LINEAR, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.EMBEDDING, OpKind.POS_EMBEDDING,
    OpKind.ROTARY, OpKind.ATTENTION_FLASH, OpKind.ATTENTION_EAGER, OpKind.DROPOUT, OpKind.GELU, OpKind.SILU,
})

BATCH, SEQ = 2, 16


@cache
def model_config(preset: str, attention: str) -> ModelConfig:
    model = load_preset(preset).model
    if attention == "flash":
        assert model.attention is AttentionImpl.FLASH
        return model
    # model_copy(update=...) would skip validation; go through the validator instead
    return ModelConfig.model_validate({**model.model_dump(), "attention": attention, "dropout": 0.1})


@cache
def graph_for(preset: str, attention: str, policy: PrecisionPolicy) -> LayerGraph:
    return build_graph(model_config(preset, attention), BATCH, SEQ, precision_spec(policy))


@cache
def reference_modules(preset: str, attention: str) -> dict[str, torch.nn.Module]:
    with torch.device("meta"):
        return dict(build_model(model_config(preset, attention)).named_modules())


@cache
def reference_params(preset: str, attention: str) -> dict[str, int]:
    with torch.device("meta"):
        return {name: p.numel() for name, p in build_model(model_config(preset, attention)).named_parameters()}


CASES = [
    pytest.param(preset, attention, policy, id=f"{preset}-{attention}-{policy.value}")
    for preset in ("tiny-llama", "tiny-gpt2")
    for attention in ("flash", "eager")
    for policy in PrecisionPolicy
]


# --------------------------------------------------------------------------------------------
# the registry


def test_every_op_kind_has_a_formula() -> None:
    assert catalog.registered_kinds() == frozenset(OpKind)
    for kind in OpKind:
        assert callable(catalog.formula_for(kind))


def test_registering_a_kind_twice_is_rejected() -> None:
    original = catalog.formula_for(OpKind.LINEAR)

    def dummy(spec: LayerSpec, ctx: OpContext) -> LayerCost:
        """Never used."""
        raise AssertionError

    with pytest.raises(ValueError, match="linear"):
        registry.register(OpKind.LINEAR)(dummy)
    assert catalog.formula_for(OpKind.LINEAR) is original


def test_duplicate_registration_on_a_fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", {})

    def first(spec: LayerSpec, ctx: OpContext) -> LayerCost:
        """First."""
        raise AssertionError

    def second(spec: LayerSpec, ctx: OpContext) -> LayerCost:
        """Second."""
        raise AssertionError

    registry.register(OpKind.GELU)(first)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(OpKind.GELU)(second)
    assert registry._REGISTRY[OpKind.GELU] is first


def _module_functions() -> list[tuple[ModuleType, str]]:
    out = []
    for name in FORMULA_MODULES:
        module = importlib.import_module(f"planner.ops.{name}")
        for fname, func in inspect.getmembers(module, inspect.isfunction):
            if func.__module__ == module.__name__:
                out.append((module, fname))
    return out


_UNDOCUMENTED: set[str] = set()  # every formula function is documented


@pytest.mark.parametrize(
    ("module", "fname"),
    [
        pytest.param(
            module, fname, id=f"{module.__name__}.{fname}",
            marks=[pytest.mark.xfail(strict=True, reason="product: helper has no docstring (reported)")]
            if f"{module.__name__}.{fname}" in _UNDOCUMENTED else [],
        )
        for module, fname in _module_functions()
    ],
)
def test_formula_module_functions_have_docstrings(module: ModuleType, fname: str) -> None:
    doc = inspect.getdoc(getattr(module, fname))
    assert doc and doc.strip(), f"{module.__name__}.{fname} has no docstring"


def test_every_registered_formula_is_documented_and_lives_in_a_formula_module() -> None:
    modules = {f"planner.ops.{name}" for name in FORMULA_MODULES}
    for kind in OpKind:
        formula = catalog.formula_for(kind)
        assert formula.__module__ in modules, (kind, formula.__module__)
        assert inspect.getdoc(formula), kind


# --------------------------------------------------------------------------------------------
# every formula on every node of built graphs


@pytest.mark.parametrize(("preset", "attention", "policy"), CASES)
def test_formula_costs_are_well_formed(preset: str, attention: str, policy: PrecisionPolicy) -> None:
    graph = graph_for(preset, attention, policy)
    for op in graph.nodes:
        cost = op.cost
        name = op.spec.name
        assert isinstance(cost, LayerCost), name
        assert catalog.cost_of(op.spec, _context(graph, name)) == cost, name  # pure: same answer again
        assert len(cost.saves_inputs) in (0, len(op.inputs)), name
        assert len(cost.grad_aliases_inputs) in (0, len(op.inputs)), name
        for value in (cost.fwd_flops, cost.bwd_input_flops, cost.bwd_weight_flops, cost.fwd_bytes_moved,
                      cost.bwd_bytes_moved, cost.fwd_transient_bytes, cost.bwd_transient_bytes):
            assert value >= 0, name
        assert cost.output.numel > 0, name
        assert all(b >= 0 for b in cost.saved_extra_bytes + cost.autocast_copy_bytes), name
        if cost.matmul:
            assert cost.fwd_flops > 0, name


def _context(graph: LayerGraph, name: str) -> OpContext:
    op = graph.node(name)
    infos = tuple(graph.node(producer).cost.output for producer in op.inputs)
    if op.spec.kind is OpKind.ROPE_TABLES:  # built from the info of the residual stream just before it
        infos = (graph.node(graph.order[graph.order.index(name) - 1]).cost.output,)
    return OpContext(batch=graph.batch, seq_len=graph.seq_len, precision=graph.precision, inputs=infos)


@pytest.mark.parametrize(("preset", "attention", "policy"), CASES)
def test_linear_flops_follow_the_lecture(preset: str, attention: str, policy: PrecisionPolicy) -> None:
    # lecture (docs/references.md "Counting FLOPs"): B x D @ D x K costs 2*B*D*K forward, backward = 2 x forward
    graph = graph_for(preset, attention, policy)
    tokens = BATCH * SEQ
    for op in graph.nodes:
        if op.spec.kind is OpKind.LINEAR:
            forward = 2 * tokens * op.spec.in_features * op.spec.out_features
            assert op.cost.fwd_flops == forward, op.spec.name
            assert op.cost.bwd_flops == 2 * forward, op.spec.name
            assert op.cost.matmul


# --------------------------------------------------------------------------------------------
# graph structure


@pytest.mark.parametrize(("preset", "attention", "policy"), CASES)
def test_graph_is_a_dag_in_topological_order(preset: str, attention: str, policy: PrecisionPolicy) -> None:
    graph = graph_for(preset, attention, policy)
    g = graph.graph
    assert nx.is_directed_acyclic_graph(g)
    assert len(graph.order) == len(set(graph.order)) == g.number_of_nodes()
    assert set(graph.order) == set(g.nodes)
    position = {name: i for i, name in enumerate(graph.order)}
    for u, v in g.edges:
        assert position[u] < position[v], (u, v)
    for name in graph.order:
        op = graph.node(name)
        assert op.spec.name == name
        assert set(op.inputs) == set(g.predecessors(name)), name
        for index, producer in enumerate(op.inputs):
            assert g.edges[producer, name]["index"] == index
    # one sink: the loss, last in the order
    assert graph.order[-1] == "loss"
    assert [n for n in g.nodes if g.out_degree(n) == 0] == ["loss"]


@pytest.mark.parametrize(("preset", "attention", "policy"), CASES)
def test_node_names_are_reference_module_names(preset: str, attention: str, policy: PrecisionPolicy) -> None:
    graph = graph_for(preset, attention, policy)
    modules = reference_modules(preset, attention)
    checked = 0
    for op in graph.nodes:
        if op.spec.kind in MODULE_KINDS:
            assert op.spec.name in modules, f"{op.spec.name} ({op.spec.kind.value}) is not a reference module"
            checked += 1
            module = modules[op.spec.name]
            if op.spec.kind is OpKind.LINEAR:
                assert isinstance(module, torch.nn.Linear)
                assert (module.in_features, module.out_features) == (op.spec.in_features, op.spec.out_features)
                assert (module.bias is not None) == any(p.name.endswith(".bias") for p in op.spec.params)
            if op.spec.kind is OpKind.EMBEDDING:
                assert isinstance(module, torch.nn.Embedding)
                assert (module.num_embeddings, module.embedding_dim) == (op.spec.in_features, op.spec.out_features)
    model = model_config(preset, attention)
    linears_per_block = 7 if model.mlp.value == "swiglu" else 6
    assert checked >= model.n_layers * linears_per_block
    # every Linear of the reference model appears in the graph
    reference_linears = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    assert reference_linears <= set(graph.order)


@pytest.mark.parametrize(("preset", "attention", "policy"), CASES)
def test_block_tags_match_names(preset: str, attention: str, policy: PrecisionPolicy) -> None:
    graph = graph_for(preset, attention, policy)
    for op in graph.nodes:
        parts = op.spec.name.split(".")
        expected = int(parts[1]) if parts[0] == "blocks" else None
        assert op.spec.block == expected, op.spec.name
        assert graph.graph.nodes[op.spec.name]["block"] == expected
    assert sorted(graph.block_nodes) == list(range(graph.model.n_layers))


@pytest.mark.parametrize(("preset", "attention", "policy"), CASES)
def test_param_counts_match(preset: str, attention: str, policy: PrecisionPolicy) -> None:
    graph = graph_for(preset, attention, policy)
    model = model_config(preset, attention)
    assert graph.n_params == count_params(model)
    # same state-dict names and sizes as the reference torch module (tied weights once)
    assert graph.param_tensors == reference_params(preset, attention)
    for op in graph.nodes:
        for param in op.spec.params:
            if op.spec.owns_params:
                assert param.name.rsplit(".", 1)[0] == op.spec.name, (op.spec.name, param.name)


def test_eager_with_dropout_adds_mask_and_dropout_nodes() -> None:
    flash = graph_for("tiny-llama", "flash", PrecisionPolicy.BF16_MIXED)
    eager = graph_for("tiny-llama", "eager", PrecisionPolicy.BF16_MIXED)

    def kinds(g: LayerGraph) -> list[OpKind]:
        return [op.spec.kind for op in g.nodes]

    assert OpKind.CAUSAL_MASK not in kinds(flash) and OpKind.CAUSAL_MASK in kinds(eager)
    assert OpKind.ATTENTION_EAGER in kinds(eager) and OpKind.ATTENTION_FLASH not in kinds(eager)
    assert OpKind.DROPOUT not in kinds(flash) and OpKind.DROPOUT in kinds(eager)
