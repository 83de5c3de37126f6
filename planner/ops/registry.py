"""The formula registry: one pure ``(spec, context) -> LayerCost`` function per op kind.

Modelled on ``torch.utils.flop_counter``'s ``register_flop_formula``: a decorator binds a
function to kinds and refuses a second registration, and a test proves every ``OpKind`` has one.
The families register themselves when imported; ``planner.ops.catalog`` imports them all and is
where formulas are looked up (so this module imports no family: no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable

from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, OpVariant

Formula = Callable[[LayerSpec, OpContext], LayerCost]
_REGISTRY: dict[OpKind, Formula] = {}
_VARIANTS: dict[tuple[OpKind, OpVariant], Formula] = {}


def register(*kinds: OpKind) -> Callable[[Formula], Formula]:
    def decorate(formula: Formula) -> Formula:
        for kind in kinds:
            if kind in _REGISTRY:
                raise ValueError(f"a cost formula for {kind.value} is already registered ({_REGISTRY[kind].__name__})")
            _REGISTRY[kind] = formula
        return formula

    return decorate


def register_variant(kind: OpKind, *variants: OpVariant) -> Callable[[Formula], Formula]:
    """Bind a formula to how another implementation runs ``kind`` (``LayerSpec.variant``)."""
    def decorate(formula: Formula) -> Formula:
        for variant in variants:
            if (kind, variant) in _VARIANTS:
                raise ValueError(f"a cost formula for {kind.value}/{variant.value} is already registered "
                                 f"({_VARIANTS[kind, variant].__name__})")
            _VARIANTS[kind, variant] = formula
        return formula

    return decorate


def registered_variant(kind: OpKind, variant: OpVariant) -> Formula:
    """The formula for ``kind`` run as ``variant`` (the kind's own for the reference)."""
    return _REGISTRY[kind] if variant is OpVariant.REFERENCE else _VARIANTS[kind, variant]


def registered_variants() -> frozenset[tuple[OpKind, OpVariant]]:
    """The (kind, variant) pairs registered so far."""
    return frozenset(_VARIANTS)


def registered(kind: OpKind) -> Formula:
    """The formula registered for ``kind`` (``KeyError`` if its family is not imported)."""
    return _REGISTRY[kind]


def registered_kinds() -> frozenset[OpKind]:
    """The kinds registered so far."""
    return frozenset(_REGISTRY)
