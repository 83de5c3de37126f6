"""Every cost formula: importing this module imports each family, whose ``@register`` decorators
fill the registry (``planner.ops.registry``). Look formulas up here."""

from __future__ import annotations

from planner.ops import (  # noqa: F401  (registers them; impl_*: other implementations' variants)
    attention,
    collectives,
    elementwise,
    embedding,
    gemma,
    impl_losses,
    impl_ops,
    linear,
    llama4,
    loss,
    mla,
    moe,
    norm,
    pipeline,
    rotary,
    scale,
)
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind
from planner.ops.registry import Formula, registered, registered_kinds, registered_variant


def formula_for(kind: OpKind) -> Formula:
    return registered(kind)


def cost_of(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    return registered_variant(spec.kind, spec.variant)(spec, ctx)


__all__ = ["cost_of", "formula_for", "registered_kinds"]
