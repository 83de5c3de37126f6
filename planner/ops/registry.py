"""The formula registry: one pure ``(spec, context) -> LayerCost`` function per op kind.

Modelled on ``torch.utils.flop_counter``'s ``register_flop_formula``: a decorator binds a
function to kinds and refuses a second registration, and a test proves every ``OpKind`` has one.
The families register themselves when imported; ``planner.ops.catalog`` imports them all and is
where formulas are looked up (so this module imports no family: no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable

from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind

Formula = Callable[[LayerSpec, OpContext], LayerCost]
_REGISTRY: dict[OpKind, Formula] = {}


def register(*kinds: OpKind) -> Callable[[Formula], Formula]:
    def decorate(formula: Formula) -> Formula:
        for kind in kinds:
            if kind in _REGISTRY:
                raise ValueError(f"a cost formula for {kind.value} is already registered ({_REGISTRY[kind].__name__})")
            _REGISTRY[kind] = formula
        return formula

    return decorate


def registered(kind: OpKind) -> Formula:
    """The formula registered for ``kind`` (``KeyError`` if its family is not imported)."""
    return _REGISTRY[kind]


def registered_kinds() -> frozenset[OpKind]:
    """The kinds registered so far."""
    return frozenset(_REGISTRY)
