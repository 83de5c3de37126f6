"""Tensor parallelism of the reference MoE block (``validate.models.moe.MoE``), as
``planner.parallel.tensor_moe`` prices it: torchtitan's ``apply_moe_ep_tp`` on our module names.

- ``mlp``: ``PrepareModuleInputOutput``: the input all-gathered from Shard(1) (sequence
  parallelism) or taken as it is (Replicate), handed to ``MoE.forward`` as a Replicate DTensor
  (which takes its local tensor with a Partial gradient); the output, a partial sum, made
  whole: reduce-scattered to Shard(1) or all-reduced to Replicate.
- ``mlp.experts``: torchtitan's ``TensorParallel``: the (E, D, I) gate and up weights Shard(2),
  the (E, I, D) down weights Shard(1); the experts run on the local shards (``models.moe.local``).
- ``mlp.router``, ``mlp.shared_gate``: Replicate weights (torchtitan's ``NoParallel``), run on the
  local view, their gradients all-reduced (``models.moe.replicated_linear``).
- ``mlp.shared_expert``: gate and up Shard(0) (colwise), down Shard(1) (rowwise, output partial).

Under expert parallelism the block holds E/ep experts (``build_model(..., ep)``); their weights
are split the same way over the tensor-parallel ranks (torchtitan's ``ExpertTensorParallel`` with
etp = tp, its [Shard(0), Shard(1 or 2)] on the (ep, tp) mesh, written as the rank's E/ep experts
sharded over tp).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput
from torch.distributed.tensor.parallel.style import ParallelStyle

from validate.models.moe import MoE


class LocalShards(ParallelStyle):
    """Distribute a module's own parameters as ``placements`` (by name) on the tensor-parallel
    mesh, with no input or output hooks: the module computes on their local shards."""

    def __init__(self, placements: dict[str, Placement]) -> None:
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: Any) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                placement = self.placements[name]
                mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                          requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, partition)  # type: ignore[arg-type]


def moe_tensor_parallel_plan(moe: MoE, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of one MoE block, keyed by module name under the transformer block."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "mlp": PrepareModuleInputOutput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                        use_local_input=False, output_layouts=(Partial(),),
                                        desired_output_layouts=(stream,), use_local_output=True),
        "mlp.experts.gate_proj": LocalShards({"weight": Shard(2)}),
        "mlp.experts.up_proj": LocalShards({"weight": Shard(2)}),
        "mlp.experts.down_proj": LocalShards({"weight": Shard(1)}),
        "mlp.router": LocalShards({"weight": Replicate(), "bias": Replicate()}),
    }
    if moe.shared_expert is not None:
        plan["mlp.shared_expert.gate_proj"] = LocalShards({"weight": Shard(0)})
        plan["mlp.shared_expert.up_proj"] = LocalShards({"weight": Shard(0)})
        plan["mlp.shared_expert.down_proj"] = LocalShards({"weight": Shard(1)})
    if moe.shared_gate is not None:
        plan["mlp.shared_gate"] = LocalShards({"weight": Replicate()})
    return plan


def bind_tensor_parallel_group(moe: MoE, mesh: Any) -> None:
    """The group the router's gradients are all-reduced over."""
    moe.tp_group = mesh.get_group()
