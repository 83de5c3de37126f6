"""Tensor parallelism of a mixture-of-experts block, as torchtitan runs it (``apply_moe_ep_tp`` in
torchtitan/models/llama4/parallelize.py and ``TensorParallel`` / ``ExpertTensorParallel`` in
torchtitan/distributed/expert_parallel.py, at c4b409af2^, the last commit with expert tensor
parallelism; its ep = 1 path is today's ``moe_sharding.py`` dense family):

| module | style | this rank |
|---|---|---|
| the MoE (``mlp``) | PrepareModuleInputOutput(Shard(1) or Replicate -> Replicate; Partial -> Shard(1) or Replicate) | one all-gather in (SP; none without), one reduce-scatter (SP) or all-reduce out |
| ``router``, ``shared_gate`` | NoParallel (Replicate weight), output gradient Partial | the whole linear on all N tokens; its weight gradient all-reduced |
| slots, dispatch, route, combine | (local) | all N tokens, their N k rows |
| ``experts.gate_proj``, ``experts.up_proj`` | TensorParallel: (E, D, I) weights Shard(2) | I/t of every expert's inner size |
| ``experts.down_proj`` | TensorParallel: (E, I, D) weights Shard(1) | I/t inputs: partial sums |
| ``shared_expert.gate_proj/up_proj``, ``down_proj`` | ColwiseParallel / RowwiseParallel(output Partial) | S/t of the shared inner size, partial sums |

Inside the block every tensor is local (torchtitan's ``MoE.forward`` takes
``x.to_local(grad_placements=Partial)``; its experts run on ``w.to_local()``): the experts' and
shared experts' outputs are partial sums, added and weighted as such, and the input gradient is
partial on every path (the router's too: the routing weights' gradient is a partial sum of the
experts' outputs), so one collective at the block's exit and one gradient collective at its entry
make it whole. Under expert parallelism (``planner.parallel.expert``, applied after this) a
rank holds E/ep of these experts (torchtitan's ExpertTensorParallel with etp = tp: the routed
rows of all N tokens go to the ep group of ranks with the same tensor-parallel coordinate).
"""

from __future__ import annotations

from dataclasses import replace

from planner.graph.description import ModelDesc, OpDesc, TpRole
from planner.model.config import ModelConfig
from planner.ops.base import OpKind, OpVariant
from planner.plan.layout_rules import check_moe_tensor_parallel as check_moe_tensor_parallel  # re-export


def moe_regions(desc: ModelDesc, model: ModelConfig) -> dict[str, str]:
    """Op name -> its MoE block's module prefix (``blocks.<b>.mlp``), for the ops of sparse blocks."""
    moe = model.moe
    if moe is None:
        return {}
    return {op.name: f"blocks.{op.block}.mlp" for op in desc.ops
            if op.block is not None and moe.is_sparse(op.block) and op.name.startswith(f"blocks.{op.block}.mlp.")}


def shard_moe_op(op: OpDesc, tp: int, group: dict[str, int]) -> OpDesc:
    """One op of a MoE block on one tensor-parallel rank (see the module docstring); the shared
    experts' linears arrive already split colwise or rowwise (``planner.parallel.tensor``)."""
    if op.kind is OpKind.GROUPED_LINEAR:
        i, o = int(op.field("in_features")), int(op.field("out_features"))
        weight = op.params[0]
        if op.tp is TpRole.COLWISE:  # (E, D, I) Shard(2): FSDP2 still shards dim 1 (D rows)
            local = weight.model_copy(update={"numel": weight.numel // tp})
            fields = {"out_features": o // tp}
        else:  # (E, I, D) Shard(1): I/t rows along the dim FSDP2 shards
            local = weight.model_copy(update={"numel": weight.numel // tp, "rows": i // tp})
            fields = {"in_features": i // tp}
        return replace(op, params=(local,)).with_fields(variant=OpVariant.LOCAL_WEIGHT, **fields)
    if op.kind is OpKind.LINEAR and op.tp in (TpRole.COLWISE, TpRole.ROWWISE):  # split by the caller
        return op.with_fields(variant=OpVariant.LOCAL_WEIGHT)
    if op.kind is OpKind.LINEAR:  # router, shared-expert gate: whole, weight gradient all-reduced
        return op.with_fields(variant=OpVariant.REPLICATED_WEIGHT, **group)
    return op


def describe_moe_tensor_parallel(model: ModelConfig, tp: int) -> str:
    """What tensor parallelism does to the MoE blocks, for the report."""
    moe = model.moe
    if moe is None:
        return ""
    shared = f", the shared experts {moe.shared_d_ff // tp} of {moe.shared_d_ff}" if moe.shared_d_ff else ""
    return (f"; MoE blocks: every expert's inner size {moe.d_ff_expert // tp} of {moe.d_ff_expert}{shared}, the "
            "router whole on all tokens, one collective in and one out per block")
