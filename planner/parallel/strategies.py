"""One strategy per way of sharing the work between ranks (``base``: one GPU; ``ddp``: DDP and
ZeRO-1; ``fsdp2``: ZeRO-2/3). ``strategy_for`` is the only place a layout is decoded."""

from __future__ import annotations

from planner.parallel.base import SingleDevice
from planner.parallel.ddp import Ddp, ZeroOne
from planner.parallel.fsdp2 import Fsdp2
from planner.plan.parallel_dims import ParallelDims, Sharding

_BY_SHARDING = {
    Sharding.OPTIMIZER: ZeroOne(),
    Sharding.GRADIENTS: Fsdp2(reshard_after_forward=False),
    Sharding.FULL: Fsdp2(reshard_after_forward=True),
}
_SINGLE, _DDP = SingleDevice(), Ddp()


def strategy_for(dims: ParallelDims) -> SingleDevice:
    """The data-parallel strategy of a layout (one GPU, DDP, ZeRO-1 or FSDP2)."""
    if dims.sharding is not None:
        return _BY_SHARDING[dims.sharding]
    return _DDP if dims.dp_replicate > 1 else _SINGLE


__all__ = ["Ddp", "Fsdp2", "SingleDevice", "ZeroOne", "strategy_for"]
