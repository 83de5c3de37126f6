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
(``ParallelDims`` checks the last).
"""

from __future__ import annotations

from dataclasses import replace

from planner.config import AttentionImpl, Implementation, LossKind, ModelConfig, PositionKind, effective_loss
from planner.description import ModelDesc
from planner.errors import ConfigError
from planner.ops.base import OpKind
from planner.parallel_dims import ParallelDims

# the shortest share of a sequence a searched context-parallel degree leaves a rank: below it the
# ring's blocks ((T/2cp) x (T/cp) per step) are shorter than the lengths where FlashAttention's
# published rates level off (4-8k tokens, docs/kernel_benchmarks.md) and the key/value all-gather
# hides behind less work (torchtitan applies CP to sequences of 32k tokens and more). It also keeps
# the layout search within its time budget (benchmarks/plan_speed.py); --cp fixes any degree
MIN_CONTEXT_SHARD_TOKENS = 4096


def check_context_parallel(model: ModelConfig, seq_len: int, dims: ParallelDims) -> None:
    """Refuse layouts PyTorch cannot run as planned, naming the field and the fix."""
    cp = dims.cp
    if cp == 1:
        return
    if model.implementation is not Implementation.REFERENCE or effective_loss(model) is not LossKind.PLAIN:
        raise ConfigError(f"parallel.cp: context parallelism is modelled for the reference implementation with the "
                          f"plain loss, not {model.implementation.value} with the {effective_loss(model).value} loss; "
                          f"use cp 1 (data parallelism) or implementation: reference")
    if model.mla is not None:
        raise ConfigError(f"parallel.cp: context parallelism of {model.name}'s multi-head latent attention (query/key "
                          "and value head dims differ) is not modelled yet; use cp 1")
    if model.attention is not AttentionImpl.FLASH:
        raise ConfigError(f"parallel.cp: context parallelism runs scaled_dot_product_attention as ring attention; "
                          f"{model.name} uses eager attention: use attention: flash, or cp 1")
    if model.positions is not PositionKind.ROTARY:
        raise ConfigError(f"parallel.cp: {model.name} adds learned positions to the whole sequence, which context "
                          "parallelism (as torchtitan runs it, sharding rotary tables) does not model: use a rotary "
                          "model, or cp 1")
    if seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp: load-balanced context parallelism splits each sequence into 2 x cp = {2 * cp} "
                          f"equal chunks; seq_len {seq_len} does not divide: use a seq_len divisible by {2 * cp}, or "
                          "another cp")


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
