"""The formula registry: one pure ``(spec, context) -> LayerCost`` function per op kind.

Modelled on ``torch.utils.flop_counter``'s ``register_flop_formula``: a decorator binds a
function to kinds and refuses a second registration, and a test proves every ``OpKind`` has one.
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


def formula_for(kind: OpKind) -> Formula:
    _load_families()
    return _REGISTRY[kind]


def registered_kinds() -> frozenset[OpKind]:
    _load_families()
    return frozenset(_REGISTRY)


def cost_of(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    return formula_for(spec.kind)(spec, ctx)


def _load_families() -> None:
    # Importing the family modules runs their @register decorators (once).
    from planner.ops import attention, elementwise, embedding, linear, loss, norm  # noqa: F401
