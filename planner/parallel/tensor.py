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

from planner.graph.blocks import describe
from planner.graph.description import ModelDesc, OpDesc, TpRole
from planner.model.config import ModelConfig, PositionKind
from planner.ops.base import OpKind, ParamTensor
from planner.parallel.expert import shard_experts
from planner.parallel.tensor_moe import (
    describe_moe_tensor_parallel,
    moe_regions,
    shard_moe_op,
)
from planner.plan.layout_rules import check_tensor_parallel as check_tensor_parallel  # re-export: the rule lives there
from planner.plan.parallel_dims import ParallelDims


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
    rewrite = _TpRewrite(desc, model, tp, sequence_parallel, ranks_per_node)
    for op in desc.ops:
        inputs = tuple(rewrite.rename.get(name, name) for name in op.inputs)
        prefix = rewrite.regions.get(op.name)
        if prefix is not None:
            rewrite.moe_op(op, inputs, prefix)
        else:
            rewrite.dense_op(op, rewrite.stream_entering_blocks(op, inputs))
    return ModelDesc(ops=tuple(rewrite.ops), held_until=rewrite.holds(desc))


class _TpRewrite:
    """The state of one pass over the description: the ops written so far, and which tensors the
    collectives it inserted replace, enter a colwise group or are split along the sequence."""

    def __init__(self, desc: ModelDesc, model: ModelConfig, tp: int, sequence_parallel: bool,
                 ranks_per_node: int) -> None:
        self.model, self.tp, self.sp = model, tp, sequence_parallel
        self.group = {"group_size": tp, "ranks_per_node": ranks_per_node}
        self.ops: list[OpDesc] = []
        self.rename: dict[str, str] = {}  # tensor -> the collective its consumers read instead
        self.entries: dict[str, str] = {}  # colwise group input -> its entry collective
        self.sharded: set[str] = set()  # tensors split along the sequence (SP)
        self.ends: dict[str, str] = {}  # module-call frames that now end at a collective
        self.scatter_before_blocks = sequence_parallel and model.positions is PositionKind.LEARNED
        # MoE blocks: one collective in, one out (planner.parallel.tensor_moe)
        self.regions = moe_regions(desc, model)
        self.exits = {prefix: name for name, prefix in self.regions.items()}  # each block's last op (its output)
        self.moe_inputs = {self.regions[op.name]: x for op in reversed(desc.ops) if op.name in self.regions
                           for x in op.inputs if x not in self.regions}  # each block's input (its norm's output)

    def collective(self, name: str, kind: OpKind, source: str, block: int | None) -> str:
        self.ops.append(OpDesc(name=name, kind=kind, inputs=(source,), block=block, tp=TpRole.REPLICATE,
                               fields=tuple(sorted(self.group.items()))))
        return name

    def made_whole(self, name: str, source: str, block: int | None) -> None:
        """The partial sums of ``source`` made whole: reduce-scatter (SP) or all-reduce; the
        frame of ``source`` now ends at the collective."""
        kind = OpKind.REDUCE_SCATTER_TO_SEQUENCE if self.sp else OpKind.REDUCE_FROM_REGION
        out = self.collective(name, kind, source, block)
        if self.sp:
            self.sharded.add(out)
        self.rename[source] = self.ends[source] = out

    def entry(self, x: str, owner: str, block: int | None) -> str:
        """The collective a module's input goes through first: gathered (SP) or taken as it is."""
        if x not in self.entries:
            kind = OpKind.GATHER_FROM_SEQUENCE if x in self.sharded else OpKind.COPY_TO_REGION
            self.entries[x] = self.collective(f"{owner}.tp_in", kind, x, block)
        return self.entries[x]

    def moe_op(self, op: OpDesc, inputs: tuple[str, ...], prefix: str) -> None:
        """An op of a MoE block: the block's input enters once, its output is made whole once."""
        x = self.rename.get(self.moe_inputs[prefix], self.moe_inputs[prefix])
        entry = self.entry(x, prefix, op.block)
        op = replace(op, inputs=tuple(entry if name == x else name for name in inputs))
        if op.kind is OpKind.LINEAR and op.tp is TpRole.COLWISE:
            op = _colwise(op, self.tp)
        elif op.kind is OpKind.LINEAR and op.tp is TpRole.ROWWISE:
            op = _rowwise(op, self.tp)
        self.ops.append(shard_moe_op(op, self.tp, self.group))
        if self.exits[prefix] == op.name:  # the MoE block's output
            self.made_whole(f"{prefix}.tp_out", op.name, op.block)

    def stream_entering_blocks(self, op: OpDesc, inputs: tuple[str, ...]) -> tuple[str, ...]:
        """Learned positions are added to the whole sequence: under SP the stream is sharded as it
        enters the blocks."""
        if not (self.scatter_before_blocks and op.block == 0 and op.tp is TpRole.SEQUENCE
                and inputs[0] not in self.sharded):
            return inputs
        stream = self.collective("blocks.0.tp_scatter", OpKind.SCATTER_TO_SEQUENCE, inputs[0], 0)
        self.sharded.add(stream)
        self.rename[inputs[0]] = stream
        return (stream, *inputs[1:])

    def dense_op(self, op: OpDesc, inputs: tuple[str, ...]) -> None:
        """Any other op, as its ``TpRole`` says."""
        if op.kind is OpKind.LINEAR and op.tp in (TpRole.COLWISE, TpRole.VOCAB):
            owner = op.name.rsplit(".", 1)[0] if op.block is not None else op.name
            self.ops.append(replace(_colwise(op, self.tp), inputs=(self.entry(inputs[0], owner, op.block),
                                                                   *inputs[1:])))
        elif op.kind is OpKind.LINEAR and op.tp is TpRole.ROWWISE:
            self.ops.append(replace(_rowwise(op, self.tp), inputs=inputs))
            self.made_whole(f"{op.name}.tp_out", op.name, op.block)
        elif op.kind is OpKind.EMBEDDING:
            self.ops.append(replace(_vocab_rows(op, self.tp), inputs=inputs))
            to_sequence = self.sp and not self.scatter_before_blocks
            kind = OpKind.REDUCE_SCATTER_TO_SEQUENCE if to_sequence else OpKind.REDUCE_FROM_REGION
            out = self.collective(f"{op.name}.tp_out", kind, op.name, None)
            if to_sequence:
                self.sharded.add(out)
            self.rename[op.name] = out
        else:
            if op.tp is TpRole.HEADS:
                op = op.with_fields(n_heads=self.model.n_heads // self.tp, n_kv_heads=self.model.kv_heads // self.tp)
            elif op.kind is OpKind.CROSS_ENTROPY:
                op = op.with_fields(**self.group)  # loss_parallel: all-reduces of per-row statistics
            if op.tp is TpRole.SEQUENCE and any(name in self.sharded for name in inputs):
                self.sharded.add(op.name)
            self.ops.append(replace(op, inputs=inputs))

    def holds(self, desc: ModelDesc) -> tuple[tuple[str, str], ...]:
        """The frames' holds, ending where a collective now ends a module's output."""
        holds: list[tuple[str, str]] = []
        for tensor, until in desc.held_until:
            if tensor not in self.regions:  # a MoE block's own locals die when its forward returns, before its exit
                until = self.ends.get(until, until)
            holds.append((tensor, until))
            entry = self.entries.get(self.rename.get(tensor, tensor))
            if entry is not None:  # the module's forward receives the entry's output: its frame holds that too
                holds.append((entry, until))
        return tuple(holds)


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
