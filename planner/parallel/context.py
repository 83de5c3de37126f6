"""Context parallelism as torch's ``context_parallel`` runs it (torch.distributed.tensor.experimental,
torchtitan's ``train.py``): a group of ``cp`` ranks shares every sequence.

| what | this rank |
|---|---|
| tokens of each sequence | T/cp: chunks r and 2 cp - 1 - r of 2 cp (head-tail load balancing) |
| every op but attention | on its T/cp tokens (the rank's graph is built at T/cp) |
| attention (SDPA) | ring attention over the group (``planner.ops.attention.ring_attention_cost``) |
| rotary tables | at the rank's positions (T/cp rows) |
| model state | FSDP2 over the data- and context-parallel ranks together (``ParallelDims.fsdp_ranks``) |
| data batch | the step's token ids, sharded in place: the storage keeps all T tokens |

Refused, naming the field: eager attention (torch's dispatcher runs SDPA only), learned positions
(their table is indexed by position; torchtitan's context parallelism shards RoPE tables), a
sequence that does not split into 2 cp equal chunks, and DDP / ZeRO-1 beside it
(``ParallelDims`` checks the last): the rules are ``planner.plan.layout_rules``'.
"""

from __future__ import annotations

from dataclasses import replace

from planner.graph.description import ModelDesc
from planner.ops.base import OpKind
from planner.plan.layout_rules import MIN_CONTEXT_SHARD_TOKENS as MIN_CONTEXT_SHARD_TOKENS  # re-exports: the
from planner.plan.layout_rules import check_context_parallel as check_context_parallel  # rules live there
from planner.plan.parallel_dims import ParallelDims


def local_seq_len(seq_len: int, dims: ParallelDims) -> int:
    """The tokens of each sequence one rank runs."""
    return seq_len // dims.cp


def shard_context_parallel(desc: ModelDesc, cp: int, ranks_per_node: int) -> ModelDesc:
    """One context-parallel rank's description: attention as ring attention over the group (the
    graph built from it at T/cp tokens is the rank's program)."""
    if cp == 1:
        return desc
    group = {"group_size": cp, "ranks_per_node": ranks_per_node}
    ops = tuple(replace(op, kind=OpKind.ATTENTION_RING).with_fields(**group) if op.kind is OpKind.ATTENTION_FLASH
                else op for op in desc.ops)
    return ModelDesc(ops=ops, held_until=desc.held_until)


def describe_context_parallel(dims: ParallelDims, seq_len: int) -> str:
    """The context-parallel layout in words, for the report."""
    return (f"{dims.cp} GPUs per sequence: {seq_len // dims.cp} of its {seq_len} tokens each (two load-balanced "
            "chunks), ring attention (keys and values all-gathered, dk/dv passed round the ring), model state "
            f"sharded by FSDP2 over the {dims.fsdp_ranks} data- and context-parallel ranks")
