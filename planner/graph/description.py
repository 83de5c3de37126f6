"""The model as a list of op descriptions: what every op of a step's forward is, before it is
priced. ``planner.graph.blocks`` writes it for each family, ``planner.graph.implementations`` adapts it to
the implementation that runs the model, strategies that shard the model rewrite it
(``planner.parallel.strategies``), and ``planner.graph.layer_graph`` prices it.

Each ``OpDesc`` names its op after the reference model's module (``blocks.3.attn.q_proj``), says
which tensors it consumes, which parameters it owns (state-dict names and shapes) and how tensor
parallelism splits it (``TpRole``, as PyTorch's ``parallelize_module`` styles do).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from planner.ops.base import OpKind, ParamTensor


class TpRole(StrEnum):
    """How tensor parallelism runs an op (torch.distributed.tensor.parallel styles)."""

    REPLICATE = "replicate"  # every rank runs the whole op on the whole tensor
    COLWISE = "colwise"  # ColwiseParallel: out_features split, weight rows Shard(0)
    ROWWISE = "rowwise"  # RowwiseParallel: in_features split, weight Shard(1), output partial sums
    HEADS = "heads"  # runs on the rank's attention heads (attention core)
    LOCAL = "local"  # elementwise on what a colwise op produced (activations, rotary)
    SEQUENCE = "sequence"  # token-wise op of the residual stream: sequence-sharded under SP
    VOCAB = "vocab"  # embedding rows / LM head columns / loss split over the vocabulary


@dataclass(frozen=True)
class OpDesc:
    """One op of the forward. ``fields`` are ``LayerSpec`` fields (sizes, bias, dropout...)."""

    name: str
    kind: OpKind
    inputs: tuple[str, ...] = ()
    block: int | None = None
    params: tuple[ParamTensor, ...] = ()
    fields: tuple[tuple[str, object], ...] = ()
    tp: TpRole = TpRole.REPLICATE
    shape_of: str | None = None  # takes only the shape of this tensor (the rotary tables)

    def field(self, key: str, default: Any = None) -> Any:
        return dict(self.fields).get(key, default)

    def with_fields(self, **updates: object) -> OpDesc:
        merged = dict(self.fields)
        merged.update(updates)
        return replace(self, fields=tuple(sorted(merged.items())))


@dataclass(frozen=True)
class ModelDesc:
    """The ops in execution order, and which tensors a Python frame keeps alive beyond their
    last use (a module's arguments live until its ``forward`` returns): tensor -> the op whose
    completion ends the frame."""

    ops: tuple[OpDesc, ...]
    held_until: tuple[tuple[str, str], ...] = field(default=())

    @property
    def params(self) -> dict[str, ParamTensor]:
        """Unique parameter tensors in registration order (a tied weight once)."""
        out: dict[str, ParamTensor] = {}
        for op in self.ops:
            for p in op.params:
                out.setdefault(p.name, p)
        return out


# the op constructors every family's blocks are written with
def linear_op(name: str, block: int | None, x: str, i: int, o: int, bias: bool, tp: TpRole,
              owns: bool = True, shared: ParamTensor | None = None) -> OpDesc:
    """A linear ``name`` of block ``block`` (None: outside the blocks) from ``i`` to ``o`` features,
    owning its weight (or sharing ``shared``, the tied LM head) and a bias if ``bias``."""
    weight = shared or ParamTensor(name=f"{name}.weight", numel=i * o, rows=o)
    params: tuple[ParamTensor, ...] = (weight,)
    if bias:
        params += (ParamTensor(name=f"{name}.bias", numel=o),)
    fields = {"in_features": i, "out_features": o, "bias": bias}
    if not owns:
        fields["owns_params"] = False
    return OpDesc(name=name, kind=OpKind.LINEAR, inputs=(x,), block=block, params=params,
                  fields=tuple(sorted(fields.items())), tp=tp)


def simple_op(name: str, kind: OpKind, block: int | None, *inputs: str, tp: TpRole = TpRole.SEQUENCE,
              dropout: float = 0.0) -> OpDesc:
    """A parameterless op of ``inputs`` (elementwise, residual add, dropout with its probability)."""
    return OpDesc(name=name, kind=kind, inputs=inputs, block=block, tp=tp,
                  fields=(("dropout", dropout),) if dropout else ())
