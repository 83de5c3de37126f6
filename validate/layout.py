"""A plan's parallel layout applied to the reference model, the way PyTorch runs it: the device
mesh (torchtitan's dimension order, tp innermost), tensor parallelism on its ``tp`` dimension
(``validate.parallelize``), then FSDP2 on its ``dp`` dimension (``validate.apply.shard_model``).
DDP and ZeRO-1 wrap the model elsewhere (``validate.distributed``); with tensor parallelism the
planner refuses them."""

from __future__ import annotations

from typing import Any

from torch import nn

from planner.knobs import Knobs
from planner.parallel_dims import ParallelDims
from planner.precision import PrecisionSpec
from validate.apply import shard_model
from validate.parallelize import apply_tensor_parallel
from validate.reference_model import Transformer


def device_mesh(device_type: str, dims: ParallelDims) -> Any:
    """The mesh of ``dims``: 1-D over the data-parallel ranks without tensor parallelism, else
    (dp, tp) with tp innermost (its ranks are neighbours, inside a node)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dims.tp == 1:
        return init_device_mesh(device_type, (dims.data_parallel,))
    return init_device_mesh(device_type, (dims.data_parallel, dims.tp), mesh_dim_names=("dp", "tp"))


def apply_layout(model: Transformer, knobs: Knobs, spec: PrecisionSpec, mesh: Any) -> nn.Module:
    """Tensor parallelism, then FSDP2 over the data-parallel ranks, as the plan says."""
    dims = knobs.parallel
    if dims.tp > 1:
        apply_tensor_parallel(model, knobs, mesh["tp"])
    if dims.shards_parameters:
        return shard_model(model, knobs, spec, mesh["dp"] if dims.tp > 1 else mesh)
    return model
