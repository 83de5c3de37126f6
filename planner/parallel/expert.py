"""Expert parallelism as torchtitan runs it (``torchtitan/distributed/expert_parallel.py``,
``apply_fsdp`` of its MoE models): a group of ``ep`` data-parallel ranks splits every MoE block's
E experts, E/ep each, and exchanges the routed rows by all-to-all.

| what | this rank |
|---|---|
| routing, dispatch (its own N tokens' R = N k rows, expert-major) | as without ep |
| ``dispatch_a2a`` | rows for expert e go to the rank holding e: R/ep to each rank (balanced routing) |
| ``dispatch_permute`` | the rows received, (ep, E/ep, C, D) by source, regrouped (E/ep, ep C, D) by expert |
| experts | E/ep grouped matmuls over ep C rows each; their weights E/ep of the whole |
| ``combine_permute``, ``combine_a2a`` | back by source rank, then home |
| model state | the experts FSDP2-sharded over the dp_shard / ep ranks holding the same ones (their own ``fully_shard`` unit inside the block's), the rest over all dp_shard ranks |

Refused, naming the field: a model without MoE blocks, an ep that does not divide the experts;
``ParallelDims`` refuses ep without FSDP2, with context parallelism or not dividing dp_shard (the
rules are ``planner.plan.layout_rules``', the degrees a request allows ``planner.plan.layouts``').
"""

from __future__ import annotations

from dataclasses import replace

from planner.graph.description import ModelDesc, OpDesc
from planner.model.config import ModelConfig
from planner.ops.base import OpKind
from planner.plan.layout_rules import check_expert_parallel as check_expert_parallel  # re-exports: the
from planner.plan.layouts import expert_degrees as expert_degrees  # rules live there
from planner.plan.parallel_dims import ParallelDims


def shard_experts(desc: ModelDesc, ep: int, ranks_per_node: int) -> ModelDesc:
    """One expert-parallel rank's description: its E/ep experts, the rows exchanged around them."""
    if ep == 1:
        return desc
    group = {"group_size": ep, "ranks_per_node": ranks_per_node}
    ops: list[OpDesc] = []
    renamed: dict[str, str] = {}  # an op's output -> what now carries it
    for op in desc.ops:
        op = replace(op, inputs=tuple(renamed.get(t, t) for t in op.inputs))
        if op.kind is OpKind.GROUPED_LINEAR:
            moe = op.field("moe")
            local = moe.model_copy(update={"n_experts": moe.n_experts // ep})
            # the (E, out) biases (gpt-oss) are sharded by FSDP2 along their E rows: E/ep of them here
            params = tuple(p.model_copy(update={"numel": p.numel // ep, "expert_parallel": True,
                                                "rows": p.rows // ep if p.shard_dim == 0 and p.rows else p.rows})
                           for p in op.params)
            op = replace(op, params=params).with_fields(moe=local)
        ops.append(op)
        prefix = op.name.rsplit(".", 1)[0]
        if op.kind is OpKind.MOE_DISPATCH:
            sent = OpDesc(name=f"{prefix}.dispatch_a2a", kind=OpKind.ALL_TO_ALL, inputs=(op.name,), block=op.block,
                          fields=tuple(sorted(group.items())))
            grouped = OpDesc(name=f"{prefix}.dispatch_permute", kind=OpKind.PERMUTE_ROWS, inputs=(sent.name,),
                             block=op.block)
            ops += [sent, grouped]
            renamed[op.name] = grouped.name
        elif op.kind is OpKind.GROUPED_LINEAR and op.name.endswith(".down_proj"):
            moe_prefix = op.name.rsplit(".", 2)[0]  # blocks.<i>.mlp
            back = OpDesc(name=f"{moe_prefix}.combine_permute", kind=OpKind.PERMUTE_ROWS, inputs=(op.name,),
                          block=op.block)
            home = OpDesc(name=f"{moe_prefix}.combine_a2a", kind=OpKind.ALL_TO_ALL, inputs=(back.name,),
                          block=op.block, fields=tuple(sorted(group.items())))
            ops += [back, home]
            renamed[op.name] = home.name
    holds = tuple((renamed.get(a, a), renamed.get(b, b)) for a, b in desc.held_until)
    return ModelDesc(ops=tuple(ops), held_until=holds)


def describe_expert_parallel(dims: ParallelDims, model: ModelConfig) -> str:
    """The expert-parallel layout in words, for the report."""
    assert model.moe is not None
    e = model.moe.n_experts
    shard = dims.expert_shard_ranks
    fsdp = f"FSDP2-sharded over the {shard} ranks holding the same ones" if shard > 1 else "whole on each rank"
    return (f"{dims.ep} GPUs per expert group: {e // dims.ep} of the {e} experts of every MoE block each, routed "
            f"rows exchanged by all-to-all before and after the experts; experts {fsdp}")
