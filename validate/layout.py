"""A plan's parallel layout applied to the reference model, the way PyTorch runs it: the device
mesh (torchtitan's dimension order, tp innermost), tensor parallelism on its ``tp`` dimension
(``validate.parallelize``), then FSDP2 on its ``dp`` dimension, flattened with ``cp`` under
context parallelism (``validate.apply.shard_model``); context parallelism runs in the step
(``validate.context``).
DDP and ZeRO-1 wrap the model elsewhere (``validate.distributed``); with tensor parallelism the
planner refuses them."""

from __future__ import annotations

from typing import Any

from torch import nn

from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.precision import PrecisionSpec
from validate.apply import shard_model
from validate.models.moe import MoE
from validate.parallelize import apply_tensor_parallel
from validate.reference_model import Transformer


def device_mesh(device_type: str, dims: ParallelDims) -> Any:
    """The mesh of ``dims``, as the planner lays it out (``ParallelDims.mesh``: torchtitan's order,
    tp innermost, its ranks neighbours inside a node; (dp, cp, tp) under context parallelism,
    (dp_mod_ep, ep[, tp]) under expert parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh

    axes = dims.mesh
    return init_device_mesh(device_type, tuple(degree for _, degree in axes),
                            mesh_dim_names=tuple(axis.value for axis, _ in axes))


def context_mesh(mesh: Any, dims: ParallelDims) -> Any | None:
    """The context-parallel dimension of the layout's mesh (None without context parallelism)."""
    return mesh["cp"] if dims.cp > 1 else None


def _sharding_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """What FSDP2 shards over: the data-parallel ranks, and with context parallelism the
    context-parallel ranks too (torchtitan's flattened ``dp_shard_cp``: a context-parallel group
    holds one model replica, sharded); under HSDP the 2-D ``[dp_replicate, dp]`` mesh (FSDP2
    shards over its second dimension and all-reduces across its first)."""
    if dims.hsdp:
        return mesh["dp_replicate", "dp"]
    if dims.cp > 1:
        return mesh["dp", "cp"]._flatten("dp_cp")
    if dims.ep > 1:
        return mesh["dp_mod_ep", "ep"]._flatten("dp")
    return mesh["dp"] if dims.tp > 1 else mesh


def apply_layout(model: Transformer, knobs: Knobs, spec: PrecisionSpec, mesh: Any) -> nn.Module:
    """Tensor parallelism, then FSDP2 over the data-parallel (and context-parallel) ranks, as the
    plan says. Context parallelism changes no module: it runs inside the step (``train_step``
    with the context mesh)."""
    dims = knobs.parallel
    if dims.tp > 1:
        apply_tensor_parallel(model, knobs, mesh["tp"])
    experts_mesh = None
    if dims.ep > 1:  # the model was built with E/ep experts per MoE block (build_model(..., ep))
        group = mesh["ep"].get_group()
        for block in model.blocks:
            if isinstance(block.mlp, MoE):
                block.mlp.ep_group = group
        experts_mesh = mesh["dp_mod_ep"]
    if dims.shards_parameters:
        return shard_model(model, knobs, spec, _sharding_mesh(mesh, dims), experts_mesh)
    return model
