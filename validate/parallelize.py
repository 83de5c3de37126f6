"""Tensor (and sequence) parallelism applied to the reference model with PyTorch's
``parallelize_module``, as ``planner.parallel.tensor`` prices it (torchtitan's Llama plan on
our module names; the table is in that module's docstring).

The loss runs under ``loss_parallel()`` (``train_step`` enters it): the LM head keeps its
vocabulary-sharded logits as a DTensor and the cross-entropy reduces per-row statistics across
the group instead of gathering the logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from planner.model.config import MlpKind, PositionKind
from planner.plan.knobs import Knobs
from validate.models.moe import MoE
from validate.moe_parallel import bind_tensor_parallel_group, moe_tensor_parallel_plan
from validate.reference_model import Transformer


class ReplicatedModule(ParallelStyle):
    """A module every tensor-parallel rank runs whole (the norms without sequence parallelism,
    learned positions): its parameters become Replicate DTensors (views of the same storage, as
    ``SequenceParallel`` makes them), so one optimizer step sees DTensors only; its tensor inputs
    enter as Replicate DTensors and it returns local tensors. No communication, no copies."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def replicate_params(_name: str, mod: nn.Module, mesh: Any) -> None:
            for name, param in mod.named_parameters(recurse=False):
                local = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
                mod.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))

        def inputs_fn(_mod: nn.Module, inputs: Any, mesh: Any) -> Any:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def output_fn(_mod: nn.Module, outputs: Any, _mesh: Any) -> Any:
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, replicate_params, inputs_fn, output_fn)  # type: ignore[arg-type]


def tensor_parallel_plan(model: Transformer, sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the plan of every block, the plan of the model's own modules)."""
    config = model.config
    stream = Shard(1) if sequence_parallel else Replicate()
    learned = config.positions is PositionKind.LEARNED
    # learned positions are added to the whole sequence: the stream is sharded as it enters the blocks
    block_in = Replicate() if sequence_parallel and learned else stream
    block: dict[str, Any] = {
        "attn": PrepareModuleInput(input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=stream),
        "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=stream),
    }
    if config.mlp is MlpKind.SWIGLU:
        block["mlp.gate_proj"] = ColwiseParallel()
    norm: ParallelStyle = SequenceParallel() if sequence_parallel else ReplicatedModule()
    block["attn_norm"] = norm
    block["mlp_norm"] = norm
    top: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate() if learned else stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    top["final_norm"] = SequenceParallel() if sequence_parallel else ReplicatedModule()
    if learned:
        top["pos_embed"] = ReplicatedModule()
    if sequence_parallel and learned:
        top["blocks.0"] = PrepareModuleInput(input_layouts=(block_in, None, None),
                                             desired_input_layouts=(Shard(1), None, None), use_local_output=True)
    return block, top


def apply_tensor_parallel(model: Transformer, knobs: Knobs, mesh: Any) -> Transformer:
    """``parallelize_module`` over the ``tp`` mesh (a 1-D mesh or the "tp" dimension of one)."""
    block_plan, top_plan = tensor_parallel_plan(model, knobs.parallel.sp)
    for block in model.blocks:
        plan = block_plan
        if isinstance(block.mlp, MoE):  # validate.moe_parallel: one collective in, one out
            plan = {k: v for k, v in block_plan.items() if k != "mlp" and not k.startswith("mlp.")}
            plan.update(moe_tensor_parallel_plan(block.mlp, knobs.parallel.sp))
            bind_tensor_parallel_group(block.mlp, mesh)
        parallelize_module(block, mesh, plan)
    parallelize_module(model, mesh, top_plan)
    return model


@contextmanager
def meshes_outside_fake_mode() -> Iterator[None]:
    """Under fake tensors, FSDP2 over a tensor-parallel model builds a device mesh of its own
    (``DeviceMesh._concatenate`` of the dp and tp meshes, in ``FSDPParam._init_sharding_spec_tp``)
    whose rank map must be a real tensor: construct every mesh with the fake mode set aside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


def loss_context(knobs: Knobs) -> AbstractContextManager[None]:
    """``loss_parallel()`` under tensor parallelism (forward and backward of the loss)."""
    return loss_parallel() if knobs.parallel.tp > 1 else nullcontext()
