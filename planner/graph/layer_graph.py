"""The layer graph: one node per op of a training step's forward, in execution order.

Nodes are named after the reference model's modules (``blocks.3.attn.q_proj``); each carries
its ``LayerSpec`` and its ``LayerCost`` for one micro-batch, and edges carry the activation
tensors from producer to consumer (``inputs`` keeps their order). ``block`` on a node says which
transformer block it belongs to, so checkpoint units are visible in the graph.

``LayerGraph.graph`` is the same graph as a ``networkx.DiGraph`` (nodes carry ``op``, ``block``
and ``saved_bytes``, edges ``index`` and ``saved``), built on first use: the planner walks the
plain node table, so planning never imports networkx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from hardware.dtypes import DType
from planner.graph.blocks import describe
from planner.graph.description import ModelDesc, OpDesc
from planner.model.config import ModelConfig, NormPlacement
from planner.ops.base import HIDDEN_STATE_LOSSES, LayerCost, LayerSpec, OpContext, OpKind, ParamTensor, TensorInfo
from planner.ops.catalog import cost_of
from planner.precision import PrecisionSpec

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True)
class GraphNode:
    spec: LayerSpec
    cost: LayerCost
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class LayerGraph:
    """A built graph for one (model, micro-batch, seq_len, precision)."""

    model: ModelConfig
    batch: int
    seq_len: int
    precision: PrecisionSpec
    ops: dict[str, GraphNode] = field(repr=False)  # name -> node
    order: tuple[str, ...]
    # tensor -> last op of the module call that received it as an argument: Python keeps a
    # module's arguments alive until the call returns, even when autograd saves nothing of them
    held_until: dict[str, str] = field(default_factory=dict, repr=False)

    saved: dict[str, int] = field(default_factory=dict, repr=False)  # name -> saved_bytes
    # a pipeline stage before the last: backward starts from its output's received gradient
    output_grad_received: bool = False
    # a pipeline's last stage: its output (the logits) is cached until the micro-batch's backward
    # (``stage.py`` ``fwd_cache``) and then held by the schedule until the next forward returns
    stage_output: str | None = None
    edges: tuple[tuple[str, str, int, bool], ...] = field(default=(), repr=False)  # producer, consumer, slot, saved

    def node(self, name: str) -> GraphNode:
        return self.ops[name]

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The graph as a networkx DiGraph (built on first use)."""
        import networkx as nx

        g = nx.DiGraph()
        for name in self.order:
            op = self.ops[name]
            g.add_node(name, op=op, block=op.spec.block, saved_bytes=self.saved[name])
        for producer, consumer, index, saved in self.edges:
            g.add_edge(producer, consumer, index=index, saved=saved)
        return g

    def saved_bytes(self, name: str) -> int:
        """Bytes op ``name`` keeps alive for backward without checkpointing: what it saves of its
        own (statistics, masks, copies) plus its output if it or a consumer saves that output.
        A tensor saved by several ops is counted once, at its producer."""
        return self.saved[name]

    @cached_property
    def nodes(self) -> tuple[GraphNode, ...]:
        return tuple(self.node(name) for name in self.order)

    @cached_property
    def param_tensors(self) -> dict[str, int]:
        """Unique parameter tensors (state-dict name -> numel); tied weights appear once."""
        tensors: dict[str, int] = {}
        for op in self.nodes:
            for param in op.spec.params:
                tensors.setdefault(param.name, param.numel)
        return tensors

    @cached_property
    def grad_tensors(self) -> dict[str, int]:
        """Unique parameter gradients (state-dict name -> numel of the ``.grad`` autograd makes);
        frozen parameters (a fine-tuning plan's base) have none."""
        return {name: p.grad_elements for name, p in self.param_specs.items() if not p.frozen}

    @cached_property
    def trainable_tensors(self) -> dict[str, int]:
        """Unique trained parameter tensors (state-dict name -> numel): what the optimizer keeps state for."""
        return {name: p.numel for name, p in self.param_specs.items() if not p.frozen}

    @cached_property
    def n_trainable_params(self) -> int:
        return sum(self.trainable_tensors.values())

    @cached_property
    def param_specs(self) -> dict[str, ParamTensor]:
        """Unique parameter tensors with their shapes (state-dict name -> ParamTensor)."""
        specs: dict[str, ParamTensor] = {}
        for op in self.nodes:
            for param in op.spec.params:
                specs.setdefault(param.name, param)
        return specs

    @cached_property
    def buffer_bytes(self) -> tuple[int, ...]:
        """Buffers the model registers beside its parameters (not trained, never sharded): DeepSeek-V3's
        (E,) fp32 ``e_score_correction_bias`` of each MoE block."""
        return tuple(4 * op.spec.moe.n_experts for op in self.nodes
                     if op.spec.kind is OpKind.MOE_ROUTE and op.spec.moe is not None and op.spec.moe.score_correction_bias)

    @cached_property
    def n_params(self) -> int:
        return sum(self.param_tensors.values())

    @cached_property
    def block_of(self) -> dict[str, int | None]:
        """Op name -> its block index (None outside the blocks)."""
        return {op.spec.name: op.spec.block for op in self.nodes}

    @cached_property
    def block_nodes(self) -> dict[int, tuple[int, ...]]:
        """Block index -> positions (in ``order``) of its nodes."""
        blocks: dict[int, list[int]] = {}
        for position, op in enumerate(self.nodes):
            if op.spec.block is not None:
                blocks.setdefault(op.spec.block, []).append(position)
        return {block: tuple(positions) for block, positions in blocks.items()}


def without_grad(cost: LayerCost) -> LayerCost:
    """An op none of whose inputs or parameters requires grad (a fine-tuning plan's frozen
    embedding and what only it feeds): autograd records nothing (no ``grad_fn``, nothing saved),
    so what it would save is made and dropped inside its forward, as in a checkpointed unit's
    forward (``unsaved_fwd_transient_bytes``), autocast's weight copies included; its output
    requires no grad, and its backward is empty. Forward FLOPs stay (FlopCounterMode counts them)."""
    if not cost.output.requires_grad and not cost.bwd_flops:
        return cost
    saved = (cost.unsaved_fwd_transient_bytes if cost.unsaved_fwd_transient_bytes is not None
             else sum(cost.saved_extra_bytes) + cost.fwd_transient_bytes)
    return cost.model_copy(update={
        "output": cost.output.model_copy(update={"requires_grad": False}),
        "saves_inputs": (), "saves_output": False, "saved_extra_bytes": (), "extras_are_outputs": False,
        "autocast_copy_bytes": (), "fwd_transient_bytes": saved + sum(cost.autocast_copy_bytes),
        "unsaved_fwd_transient_bytes": None, "bwd_input_flops": 0.0, "bwd_weight_flops": 0.0, "exec_bwd_flops": None,
        "bwd_bytes_moved": 0.0, "bwd_kernels": 0, "bwd_transient_bytes": 0, "bwd_collectives": (),
        "grad_aliases_inputs": (), "releases_output_grad": False})


_SPEC_DEFAULTS = {name: field.default for name, field in LayerSpec.model_fields.items() if name not in ("name", "kind")}


_SPECS: dict[tuple[object, ...], LayerSpec] = {}
_COST_FIELDS = tuple(name for name in LayerSpec.model_fields if name not in ("name", "block", "params"))


def op_spec(**fields: object) -> LayerSpec:
    """The ``LayerSpec`` of an op a rewrite adds to a built graph (a pipeline stage's input)."""
    return _spec(**fields)


def _spec(**fields: object) -> LayerSpec:
    """A LayerSpec from fields the builder derived from a validated ModelConfig (no re-validation;
    memoized: the same op of the same model recurs for every micro-batch size and precision)."""
    key = tuple(sorted(fields.items()))
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) > 200_000:
            _SPECS.clear()
        spec = _SPECS[key] = LayerSpec.model_construct(**{**_SPEC_DEFAULTS, **fields})
    return spec


class _Builder:
    def __init__(self, model: ModelConfig, batch: int, seq_len: int, precision: PrecisionSpec) -> None:
        self.model, self.batch, self.seq_len, self.precision = model, batch, seq_len, precision
        self.ops: dict[str, GraphNode] = {}
        self.edges: list[tuple[str, str, int, bool]] = []
        self.order: list[str] = []
        self.costs: dict[tuple[object, ...], LayerCost] = {}
        self.alias: dict[str, str] = {}  # a described op that is its input (a cast to the same dtype)
        self.frozen_base = False  # a fine-tuning plan: ops may see no input that requires grad

    def add(self, spec: LayerSpec, inputs: tuple[str, ...] = (), info: tuple[TensorInfo, ...] | None = None) -> str:
        tensors = info if info is not None else tuple(self.output(name) for name in inputs)
        # blocks repeat: an op's cost depends on every field of its spec but its name, block index and
        # parameter names (derived from the model, so a new field a formula reads is in the key too)
        key = (*(getattr(spec, f) for f in _COST_FIELDS), tuple((p.numel, p.rows, p.frozen) for p in spec.params),
               tensors)
        cost = self.costs.get(key)
        if cost is None:
            ctx = OpContext(batch=self.batch, seq_len=self.seq_len, precision=self.precision, inputs=tensors)
            cost = cost_of(spec, ctx)
            if self.frozen_base and not any(t.requires_grad for t in tensors) and all(p.frozen for p in spec.params) and (
                    spec.params or tensors):
                cost = without_grad(cost)
            self.costs[key] = cost
        self.ops[spec.name] = GraphNode(spec=spec, cost=cost, inputs=inputs)
        for position, producer in enumerate(inputs):
            self.edges.append((producer, spec.name, position, cost.saves_input(position)))
        self.order.append(spec.name)
        return spec.name

    def output(self, name: str) -> TensorInfo:
        return self.ops[name].cost.output

    def _casts_branch(self, desc: OpDesc) -> bool:
        """Whether ``desc`` is a post-norm block's norm (``validate.reference_model.Block``) whose
        low-precision branch is cast to the fp32 stream first."""
        return (self.model.norm_placement is NormPlacement.POST and desc.block is not None
                and desc.kind in (OpKind.RMSNORM, OpKind.LAYERNORM)
                and desc.name.rsplit(".", 1)[-1] in ("attn_norm", "mlp_norm")
                and self.precision.autocast_dtype is not None and self.output(desc.inputs[0]).dtype is not DType.FP32)

    def op(self, desc: OpDesc) -> None:
        """Instantiate one described op."""
        inputs = tuple(self.alias.get(t, t) for t in desc.inputs)
        if desc.kind is OpKind.ADAPTER_CAST and self.output(inputs[0]).dtype is self.precision.param_dtype:
            self.alias[desc.name] = inputs[0]  # peft's cast returns x itself: no op
            return
        if (desc.kind is OpKind.CROSS_ENTROPY and self.output(inputs[0]).dtype.n_bytes != 4
                and desc.field("variant") not in HIDDEN_STATE_LOSSES):  # those take hidden states
            # the reference model's loss upcasts low-precision logits first (``.float()``)
            inputs = (self.add(_spec(name="logits_cast", kind=OpKind.CAST, block=None), inputs),)
        if self._casts_branch(desc):
            # a post-norm block norms its branch in the residual stream's dtype (``.to(x.dtype)``):
            # under autocast the branch is low precision and the stream fp32
            inputs = (self.add(_spec(name=f"{desc.name}_cast", kind=OpKind.CAST, block=desc.block), inputs),)
        spec = _spec(name=desc.name, kind=desc.kind, block=desc.block, params=desc.params, **dict(desc.fields))
        info = (self.output(self.alias.get(desc.shape_of, desc.shape_of)),) if desc.shape_of is not None else None
        self.add(spec, inputs, info)


def build_graph(model: ModelConfig, batch: int, seq_len: int, precision: PrecisionSpec,
                desc: ModelDesc | None = None) -> LayerGraph:
    """The forward op graph of ``model`` for a micro-batch of ``batch`` sequences of ``seq_len``:
    its description (``planner.graph.blocks.describe``, or ``desc`` as a strategy rewrote it), each op
    priced by its registered formula."""
    desc = desc or describe(model)
    g = _Builder(model, batch, seq_len, precision)
    g.frozen_base = any(p.frozen for p in desc.params.values())
    for op in desc.ops:
        g.op(op)
    consumers_save: set[str] = {producer for producer, _, _, saved in g.edges if saved}
    saved_bytes = {}
    for name in g.order:  # bytes each op's forward leaves alive for backward (no checkpointing)
        cost = g.ops[name].cost
        kept = cost.saves_output or name in consumers_save
        saved_bytes[name] = sum(cost.saved_extra_bytes) + (cost.output.n_bytes if kept else 0)
    return LayerGraph(model=model, batch=batch, seq_len=seq_len, precision=precision, ops=g.ops, saved=saved_bytes,
                      edges=tuple(g.edges),
                      order=tuple(g.order), held_until=_holds(desc, g))


def _holds(desc: ModelDesc, g: _Builder) -> dict[str, str]:
    """Tensor -> the op whose completion ends the last frame holding it (a tensor several frames
    hold, as a LoRA adapter's input inside its caller's frame, is held until the latest)."""
    if not g.alias:
        return dict(desc.held_until)
    position = {name: i for i, name in enumerate(g.order)}
    holds: dict[str, str] = {}
    for tensor, until in desc.held_until:
        tensor = g.alias.get(tensor, tensor)
        if tensor not in holds or position[until] > position[holds[tensor]]:
            holds[tensor] = until
    return holds


LOGITS_NODES = frozenset({"lm_head", "logits_softcap", "logits_cast", "loss"})  # logits_softcap: Gemma 2
