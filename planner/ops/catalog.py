"""Every cost formula: importing this module imports each family, whose ``@register`` decorators
fill the registry (``planner.ops.registry``). Look formulas up here."""

from __future__ import annotations

from planner.ops import attention, collectives, elementwise, embedding, linear, loss, norm  # noqa: F401  (registers them)
from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind
from planner.ops.registry import Formula, registered, registered_kinds


def formula_for(kind: OpKind) -> Formula:
    return registered(kind)


def cost_of(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    return registered(spec.kind)(spec, ctx)


__all__ = ["cost_of", "formula_for", "registered_kinds"]
