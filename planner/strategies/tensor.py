"""Tensor parallelism (with sequence parallelism) as PyTorch's ``parallelize_module`` runs it.

The plan applied to the reference model (``validate.apply.tensor_parallel_plan``), torchtitan's
Llama plan (torchtitan/models/llama3/infra/parallelize.py, ``apply_tp``) on our module names:

| module | style | this rank computes |
|---|---|---|
| ``embed`` | RowwiseParallel(input Replicate, output Shard(1) under SP else Replicate) | V/t rows of the table |
| ``attn_norm``, ``mlp_norm``, ``final_norm`` | SequenceParallel (SP) or nothing | T/t tokens (SP) or all |
| ``attn``, ``mlp`` | PrepareModuleInput(Shard(1) or Replicate -> Replicate) | one gather (SP) per module |
| ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` | ColwiseParallel | out_features / t |
| attention core | (local heads) | N/t query heads, K/t key/value heads |
| ``o_proj``, ``down_proj`` | RowwiseParallel(output Shard(1) under SP else Replicate) | in_features / t, partial sums |
| ``lm_head`` | ColwiseParallel(input Shard(1) or Replicate, output Shard(-1)) | V/t logits |
| loss | ``loss_parallel()`` | cross-entropy over V/t logits |

The rewrite inserts the collectives of ``planner.ops.collectives`` where the styles run them:
a copy-to-region (no SP: backward all-reduce) or a gather-from-sequence (SP) in front of every
colwise group, a reduce-from-region (no SP: all-reduce) or a reduce-scatter-to-sequence (SP)
behind every rowwise linear and the vocabulary-parallel embedding, so the graph built from the
rewritten description is one rank's program. Sizes split unevenly are chunked as DTensor's
``Shard`` does (``ceil(n/t)`` on the first ranks; rank 0 holds the most).

Korthikanti et al. 2022 (arXiv:2205.05198, Table 2) count the same tensors with one
difference under SP: Megatron-LM's linear saves its sequence-sharded input and all-gathers it
again in the backward, while DTensor's colwise linears save the gathered input, so each block
keeps two full (B, T, D) activations more than their ``34 sbh / t``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from planner.blocks import describe
from planner.config import ModelConfig, PositionKind
from planner.description import ModelDesc, OpDesc, TpRole
from planner.layout_rules import check_tensor_parallel as check_tensor_parallel  # re-export: the rule lives there
from planner.ops.base import OpKind, ParamTensor
from planner.parallel_dims import ParallelDims
from planner.strategies.expert import shard_experts
from planner.strategies.tensor_moe import (
    describe_moe_tensor_parallel,
    moe_regions,
    shard_moe_op,
)


def _chunk(n: int, ranks: int) -> int:
    """Rank 0's share of ``n`` split by ``torch.chunk`` (DTensor's Shard)."""
    return math.ceil(n / ranks)


def _param(param: ParamTensor, numel: int, rows: int) -> ParamTensor:
    return ParamTensor(name=param.name, numel=numel, rows=rows)


def _colwise(op: OpDesc, tp: int) -> OpDesc:
    """Weight (O, I) Shard(0): O/t rows; bias Shard(0)."""
    i, o = int(op.field("in_features")), int(op.field("out_features"))
    local = _chunk(o, tp)
    params = tuple(_param(p, i * local, local) if p.name.endswith("weight") else _param(p, local, 0)
                   for p in op.params)
    return replace(op, params=params).with_fields(out_features=local)


def _rowwise(op: OpDesc, tp: int) -> OpDesc:
    """Weight (O, I) Shard(1): every row, I/t columns; bias replicated."""
    i, o = int(op.field("in_features")), int(op.field("out_features"))
    local = _chunk(i, tp)
    params = tuple(_param(p, o * local, o) if p.name.endswith("weight") else p for p in op.params)
    return replace(op, params=params).with_fields(in_features=local)


def _vocab_rows(op: OpDesc, tp: int) -> OpDesc:
    """The embedding (V, D) Shard(0): V/t rows. Its gradient is whole: DTensor's sharding of
    ``embedding_dense_backward`` (a replicated output gradient and indices) writes the full
    (V, D) gradient on every rank, a Replicate ``.grad`` the optimizer step slices."""
    v, d = int(op.field("in_features")), int(op.field("out_features"))
    local = _chunk(v, tp)
    params = tuple(ParamTensor(name=p.name, numel=local * d, rows=local, grad_numel=v * d) for p in op.params)
    return replace(op, params=params).with_fields(in_features=local)


@lru_cache(maxsize=128)
def rank_description(model: ModelConfig, tp: int, sequence_parallel: bool, ranks_per_node: int) -> ModelDesc:
    """The description of one tensor-parallel rank of ``model`` (memoized: the search asks for
    the same layout at every point)."""
    return shard_tensor_parallel(describe(model), model, tp, sequence_parallel, ranks_per_node)


def shard_tensor_parallel(desc: ModelDesc, model: ModelConfig, tp: int, sequence_parallel: bool,
                          ranks_per_node: int) -> ModelDesc:
    """One tensor-parallel rank's description (see the module docstring)."""
    if tp == 1:
        return desc
    group = {"group_size": tp, "ranks_per_node": ranks_per_node}
    ops: list[OpDesc] = []
    rename: dict[str, str] = {}  # tensor -> the collective its consumers read instead
    entries: dict[str, str] = {}  # colwise group input -> its entry collective
    sharded: set[str] = set()  # tensors split along the sequence (SP)
    ends: dict[str, str] = {}  # module-call frames that now end at a collective

    def collective(name: str, kind: OpKind, source: str, block: int | None) -> str:
        ops.append(OpDesc(name=name, kind=kind, inputs=(source,), block=block, tp=TpRole.REPLICATE,
                          fields=tuple(sorted(group.items()))))
        return name

    def made_whole(name: str, source: str, block: int | None) -> None:
        """The partial sums of ``source`` made whole: reduce-scatter (SP) or all-reduce; the
        frame of ``source`` now ends at the collective."""
        kind = OpKind.REDUCE_SCATTER_TO_SEQUENCE if sequence_parallel else OpKind.REDUCE_FROM_REGION
        out = collective(name, kind, source, block)
        if sequence_parallel:
            sharded.add(out)
        rename[source] = ends[source] = out

    scatter_before_blocks = sequence_parallel and model.positions is PositionKind.LEARNED
    regions = moe_regions(desc, model)  # MoE blocks: one collective in, one out (planner.strategies.tensor_moe)
    exits = {prefix: name for name, prefix in regions.items()}  # each block's last op (its output)
    moe_inputs = {regions[op.name]: x for op in reversed(desc.ops) if op.name in regions
                  for x in op.inputs if x not in regions}  # each block's input (its norm's output)
    for op in desc.ops:
        inputs = tuple(rename.get(name, name) for name in op.inputs)
        prefix = regions.get(op.name)
        if prefix is not None:
            x = rename.get(moe_inputs[prefix], moe_inputs[prefix])
            if x not in entries:  # the module's input hook, before its forward: gathered (SP) or taken as it is
                kind = OpKind.GATHER_FROM_SEQUENCE if x in sharded else OpKind.COPY_TO_REGION
                entries[x] = collective(f"{prefix}.tp_in", kind, x, op.block)
            op = replace(op, inputs=tuple(entries[x] if name == x else name for name in inputs))
            if op.kind is OpKind.LINEAR and op.tp is TpRole.COLWISE:
                op = _colwise(op, tp)
            elif op.kind is OpKind.LINEAR and op.tp is TpRole.ROWWISE:
                op = _rowwise(op, tp)
            ops.append(shard_moe_op(op, tp, group))
            if exits[prefix] == op.name:  # the MoE block's output
                made_whole(f"{prefix}.tp_out", op.name, op.block)
            continue
        if scatter_before_blocks and op.block == 0 and op.tp is TpRole.SEQUENCE and inputs[0] not in sharded:
            # learned positions are added to the whole sequence: shard the stream as it enters the blocks
            stream = collective("blocks.0.tp_scatter", OpKind.SCATTER_TO_SEQUENCE, inputs[0], 0)
            sharded.add(stream)
            rename[inputs[0]] = stream
            inputs = (stream, *inputs[1:])
        if op.kind is OpKind.LINEAR and op.tp in (TpRole.COLWISE, TpRole.VOCAB):
            x = inputs[0]
            if x not in entries:
                owner = op.name.rsplit(".", 1)[0] if op.block is not None else op.name
                kind = OpKind.GATHER_FROM_SEQUENCE if x in sharded else OpKind.COPY_TO_REGION
                entries[x] = collective(f"{owner}.tp_in", kind, x, op.block)
            ops.append(replace(_colwise(op, tp), inputs=(entries[x], *inputs[1:])))
            continue
        if op.kind is OpKind.LINEAR and op.tp is TpRole.ROWWISE:
            ops.append(replace(_rowwise(op, tp), inputs=inputs))
            made_whole(f"{op.name}.tp_out", op.name, op.block)
            continue
        if op.kind is OpKind.EMBEDDING:
            ops.append(replace(_vocab_rows(op, tp), inputs=inputs))
            to_sequence = sequence_parallel and not scatter_before_blocks
            kind = OpKind.REDUCE_SCATTER_TO_SEQUENCE if to_sequence else OpKind.REDUCE_FROM_REGION
            out = collective(f"{op.name}.tp_out", kind, op.name, None)
            if to_sequence:
                sharded.add(out)
            rename[op.name] = out
            continue
        if op.tp is TpRole.HEADS:
            op = op.with_fields(n_heads=model.n_heads // tp, n_kv_heads=model.kv_heads // tp)
        elif op.kind is OpKind.CROSS_ENTROPY:
            op = op.with_fields(**group)  # loss_parallel: all-reduces of per-row statistics
        new = replace(op, inputs=inputs)
        if op.tp is TpRole.SEQUENCE and any(name in sharded for name in inputs):
            sharded.add(op.name)
        ops.append(new)
    holds: list[tuple[str, str]] = []
    for tensor, until in desc.held_until:
        if tensor not in regions:  # a MoE block's own locals die when its forward returns, before its exit
            until = ends.get(until, until)
        holds.append((tensor, until))
        entry = entries.get(rename.get(tensor, tensor))
        if entry is not None:  # the module's forward receives the entry's output: its frame holds that too
            holds.append((entry, until))
    return ModelDesc(ops=tuple(ops), held_until=tuple(holds))


def describe_tensor_parallel(model: ModelConfig, dims: ParallelDims) -> str:
    """The tensor-parallel layout in words, for the report."""
    heads = f"{model.n_heads // dims.tp} of {model.n_heads} heads"
    if model.kv_heads != model.n_heads:
        heads += f" ({model.kv_heads // dims.tp} of {model.kv_heads} key/value heads)"
    sp = (" with sequence parallelism (norms, dropout and residuals on T/t tokens; all-gather before each "
          "colwise group, reduce-scatter after each rowwise linear)" if dims.sp else
          " (norms and residuals whole on every rank; all-reduce after each rowwise linear and of the "
          "input gradient before each colwise group)")
    return (f"{dims.tp} GPUs per group: parallelize_module, colwise q/k/v/gate/up and LM head, rowwise o/down, "
            f"vocabulary-parallel embedding and loss, {heads} per GPU{sp}{describe_moe_tensor_parallel(model, dims.tp)}")


def rank_parameters(model: ModelConfig, dims: ParallelDims) -> int:
    """Parameters one tensor-parallel rank holds, E/ep experts of each MoE block under expert
    parallelism (before any data-parallel sharding)."""
    desc = shard_experts(rank_description(model, dims.tp, dims.sp, 1), dims.ep, 1)
    return sum(p.numel for p in desc.params.values())
