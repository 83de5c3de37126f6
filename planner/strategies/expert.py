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
``ParallelDims`` refuses ep without FSDP2, with context parallelism or not dividing dp_shard.
"""

from __future__ import annotations

from dataclasses import replace

from planner.config import ModelConfig
from planner.description import ModelDesc, OpDesc
from planner.errors import ConfigError
from planner.ops.base import OpKind
from planner.parallel_dims import ParallelDims


def check_expert_parallel(model: ModelConfig, dims: ParallelDims) -> None:
    """Refuse layouts PyTorch cannot run as planned, naming the field and the fix."""
    ep = dims.ep
    if ep == 1:
        return
    if model.moe is None:
        raise ConfigError(f"parallel.ep: {model.name} has no mixture-of-experts blocks to split; use ep 1")
    if model.moe.n_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide the {model.moe.n_experts} experts of {model.name}; use an "
                          "ep that divides n_experts")


def expert_degrees(model: ModelConfig, gpus: int, fixed: int | None) -> tuple[int, ...]:
    """The expert-parallel degrees a request allows: ``--ep`` if given (checked against the model
    and the GPUs, the error naming the flag), else every degree dividing both the GPUs and the
    experts of a model with MoE blocks (1 for a dense model); ``search.space.SearchSpace.allows`` keeps those
    that divide a point's data-parallel ranks under FSDP2."""
    if fixed is not None:
        if fixed <= 0 or gpus % fixed:
            raise ConfigError(f"--ep: {fixed} must be a positive divisor of the {gpus} GPUs (--gpus)")
        if fixed > 1 and model.moe is None:
            raise ConfigError(f"--ep: {model.name} has no mixture-of-experts blocks to split; leave --ep out")
        if fixed > 1 and model.moe is not None and model.moe.n_experts % fixed:
            raise ConfigError(f"--ep: {fixed} does not divide the {model.moe.n_experts} experts of {model.name}; use a "
                              "divisor of them")
        return (fixed,)
    if model.moe is None:
        return (1,)
    return tuple(ep for ep in range(1, gpus + 1) if gpus % ep == 0 and model.moe.n_experts % ep == 0)


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
