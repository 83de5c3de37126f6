"""The layer graph: one networkx node per op of a training step's forward, in execution order.

Nodes are named after the reference model's modules (``blocks.3.attn.q_proj``); each carries
its ``LayerSpec`` and its ``LayerCost`` for one micro-batch, and edges carry the activation
tensors from producer to consumer (``inputs`` keeps their order). ``block`` on a node says which
transformer block it belongs to, so checkpoint units are visible in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import networkx as nx

from planner.config import AttentionImpl, MlpKind, ModelConfig, NormKind, PositionKind
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, ParamTensor, TensorInfo
from planner.ops.registry import cost_of
from planner.precision import PrecisionSpec


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
    graph: nx.DiGraph = field(repr=False)
    order: tuple[str, ...]
    # tensor -> last op of the module call that received it as an argument: Python keeps a
    # module's arguments alive until the call returns, even when autograd saves nothing of them
    held_until: dict[str, str] = field(default_factory=dict, repr=False)

    def node(self, name: str) -> GraphNode:
        return self.graph.nodes[name]["op"]  # type: ignore[no-any-return]

    def saved_bytes(self, name: str) -> int:
        """Bytes op ``name`` keeps alive for backward without checkpointing: what it saves of its
        own (statistics, masks, copies) plus its output if it or a consumer saves that output.
        A tensor saved by several ops is counted once, at its producer."""
        return int(self.graph.nodes[name]["saved_bytes"])

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
    def param_specs(self) -> dict[str, ParamTensor]:
        """Unique parameter tensors with their shapes (state-dict name -> ParamTensor)."""
        specs: dict[str, ParamTensor] = {}
        for op in self.nodes:
            for param in op.spec.params:
                specs.setdefault(param.name, param)
        return specs

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


_SPEC_DEFAULTS = {name: field.default for name, field in LayerSpec.model_fields.items() if name not in ("name", "kind")}


_SPECS: dict[tuple[object, ...], LayerSpec] = {}
_COST_FIELDS = tuple(name for name in LayerSpec.model_fields if name not in ("name", "block", "params"))


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
        self.graph = nx.DiGraph()
        self.order: list[str] = []
        self.held_until: dict[str, str] = {}
        self.costs: dict[tuple[object, ...], LayerCost] = {}

    def add(self, spec: LayerSpec, inputs: tuple[str, ...] = (), info: tuple[TensorInfo, ...] | None = None) -> str:
        tensors = info if info is not None else tuple(self.output(name) for name in inputs)
        # blocks repeat: an op's cost depends on every field of its spec but its name, block index and
        # parameter names (derived from the model, so a new field a formula reads is in the key too)
        key = (*(getattr(spec, f) for f in _COST_FIELDS), tuple((p.numel, p.rows) for p in spec.params), tensors)
        cost = self.costs.get(key)
        if cost is None:
            ctx = OpContext(batch=self.batch, seq_len=self.seq_len, precision=self.precision, inputs=tensors)
            cost = self.costs[key] = cost_of(spec, ctx)
        self.graph.add_node(spec.name, op=GraphNode(spec=spec, cost=cost, inputs=inputs), block=spec.block)
        for position, producer in enumerate(inputs):
            self.graph.add_edge(producer, spec.name, index=position, saved=cost.saves_input(position))
        self.order.append(spec.name)
        return spec.name

    def output(self, name: str) -> TensorInfo:
        return self.graph.nodes[name]["op"].cost.output  # type: ignore[no-any-return]

    def linear(self, name: str, block: int | None, x: str, i: int, o: int, bias: bool, **kw: object) -> str:
        params: tuple[ParamTensor, ...] = (ParamTensor(name=f"{name}.weight", numel=i * o, rows=o),)
        if bias:
            params += (ParamTensor(name=f"{name}.bias", numel=o),)
        spec = _spec(name=name, kind=OpKind.LINEAR, block=block, in_features=i, out_features=o, bias=bias,
                     params=params, **kw)
        return self.add(spec, (x,))

    def norm(self, name: str, block: int | None, x: str) -> str:
        m = self.model
        layernorm = m.norm is NormKind.LAYERNORM
        params: tuple[ParamTensor, ...] = (ParamTensor(name=f"{name}.weight", numel=m.d_model),)
        if layernorm and m.norm_bias:
            params += (ParamTensor(name=f"{name}.bias", numel=m.d_model),)
        kind = OpKind.LAYERNORM if layernorm else OpKind.RMSNORM
        return self.add(_spec(name=name, kind=kind, block=block, in_features=m.d_model, params=params), (x,))

    def simple(self, name: str, kind: OpKind, block: int | None, *inputs: str, dropout: float = 0.0) -> str:
        return self.add(_spec(name=name, kind=kind, block=block, dropout=dropout), inputs)

    def block(self, b: int, x: str, rope: str | None, mask: str | None) -> str:
        m = self.model
        n, k, h, d = m.n_heads, m.kv_heads, m.head_dim, m.d_model
        p = f"blocks.{b}"
        normed = self.norm(f"{p}.attn_norm", b, x)
        q = self.linear(f"{p}.attn.q_proj", b, normed, d, n * h, bool(m.qkv_bias))
        kk = self.linear(f"{p}.attn.k_proj", b, normed, d, k * h, bool(m.qkv_bias))
        v = self.linear(f"{p}.attn.v_proj", b, normed, d, k * h, bool(m.qkv_bias))
        qk: tuple[str, ...] = (q, kk)
        if rope is not None:
            qk = (self.simple(f"{p}.attn.rotary", OpKind.ROTARY, b, q, kk, rope),)
        eager = m.attention is AttentionImpl.EAGER
        core_spec = _spec(
            name=f"{p}.attn.core", kind=OpKind.ATTENTION_EAGER if eager else OpKind.ATTENTION_FLASH, block=b,
            n_heads=n, n_kv_heads=k, head_dim=h, dropout=m.dropout, attention_kernel=m.attention_kernel,
        )
        core = self.add(core_spec, (*qk, v) + ((mask,) if eager and mask is not None else ()))
        attn = self.linear(f"{p}.attn.o_proj", b, core, n * h, d, bool(m.attn_out_bias))
        self.held_until[normed] = attn  # Attention.forward's argument
        if m.dropout > 0:
            attn = self.simple(f"{p}.attn_dropout", OpKind.DROPOUT, b, attn, dropout=m.dropout)
        x = self.simple(f"{p}.attn_residual", OpKind.RESIDUAL_ADD, b, x, attn)
        normed = self.norm(f"{p}.mlp_norm", b, x)
        bias = bool(m.mlp_bias)
        if m.mlp is MlpKind.SWIGLU:
            gate = self.linear(f"{p}.mlp.gate_proj", b, normed, d, m.d_ff, bias)
            act = self.simple(f"{p}.mlp.act", OpKind.SILU, b, gate)
            up = self.linear(f"{p}.mlp.up_proj", b, normed, d, m.d_ff, bias)
            hidden = self.simple(f"{p}.mlp.glu", OpKind.GLU_MUL, b, act, up)
        else:
            up = self.linear(f"{p}.mlp.up_proj", b, normed, d, m.d_ff, bias)
            hidden = self.simple(f"{p}.mlp.act", OpKind.GELU, b, up)
        mlp = self.linear(f"{p}.mlp.down_proj", b, hidden, m.d_ff, d, bias)
        self.held_until[normed] = mlp  # Mlp.forward's argument
        if m.dropout > 0:
            mlp = self.simple(f"{p}.mlp_dropout", OpKind.DROPOUT, b, mlp, dropout=m.dropout)
        return self.simple(f"{p}.mlp_residual", OpKind.RESIDUAL_ADD, b, x, mlp)


def build_graph(model: ModelConfig, batch: int, seq_len: int, precision: PrecisionSpec) -> LayerGraph:
    """The forward op graph of ``model`` for a micro-batch of ``batch`` sequences of ``seq_len``."""
    m = model
    g = _Builder(m, batch, seq_len, precision)
    embed_param = ParamTensor(name="embed.weight", numel=m.vocab_size * m.d_model, rows=m.vocab_size)
    x = g.add(LayerSpec(name="embed", kind=OpKind.EMBEDDING, in_features=m.vocab_size, out_features=m.d_model,
                        params=(embed_param,)))
    if m.positions is PositionKind.LEARNED:
        pos = g.add(LayerSpec(name="pos_embed", kind=OpKind.POS_EMBEDDING, in_features=m.position_rows,
                              out_features=m.d_model,
                              params=(ParamTensor(name="pos_embed.weight", numel=m.position_rows * m.d_model,
                                                 rows=m.position_rows),)))
        x = g.simple("embed_add", OpKind.RESIDUAL_ADD, None, x, pos)
    if m.dropout > 0:
        x = g.simple("embed_dropout", OpKind.DROPOUT, None, x, dropout=m.dropout)
    rope = None
    if m.positions is PositionKind.ROTARY:
        rope = g.add(LayerSpec(name="rope", kind=OpKind.ROPE_TABLES, head_dim=m.head_dim), (), info=(g.output(x),))
    mask = None
    if m.attention is AttentionImpl.EAGER:
        mask = g.add(LayerSpec(name="causal_mask", kind=OpKind.CAUSAL_MASK))
    for b in range(m.n_layers):
        x = g.block(b, x, rope, mask)
    x = g.norm("final_norm", None, x)
    tied = bool(m.tie_embeddings)
    head_params = (embed_param,) if tied else (
        ParamTensor(name="lm_head.weight", numel=m.vocab_size * m.d_model, rows=m.vocab_size),)
    logits = g.add(LayerSpec(name="lm_head", kind=OpKind.LINEAR, in_features=m.d_model, out_features=m.vocab_size,
                             params=head_params, owns_params=not tied), (x,))
    if g.output(logits).dtype.n_bytes != 4:
        logits = g.simple("logits_cast", OpKind.CAST, None, logits)
    loss = g.simple("loss", OpKind.CROSS_ENTROPY, None, logits)
    for shared in (rope, mask):  # locals of Transformer.forward: alive for the whole forward
        if shared is not None:
            g.held_until[shared] = loss
    for name in g.order:  # bytes each op's forward leaves alive for backward (no checkpointing)
        cost = g.graph.nodes[name]["op"].cost
        kept = cost.saves_output or any(data["saved"] for _, _, data in g.graph.out_edges(name, data=True))
        g.graph.nodes[name]["saved_bytes"] = sum(cost.saved_extra_bytes) + (cost.output.n_bytes if kept else 0)
    return LayerGraph(model=m, batch=batch, seq_len=seq_len, precision=precision, graph=g.graph,
                      order=tuple(g.order), held_until=g.held_until)


LOGITS_NODES = frozenset({"lm_head", "logits_cast", "loss"})
