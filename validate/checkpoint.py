"""A plan's checkpoint policy applied to the reference model, as PyTorch runs it
(``planner.plan.checkpointing`` says what each policy keeps and recomputes).

- ``full``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` on each planned block
  (and segment);
- ``attention``: the same on the attention core of each planned block only;
- ``ops``: the block under checkpoint with ``context_fn`` =
  ``create_selective_checkpoint_contexts(policy)``, the policy of torchtitan's per-op SAC
  (pytorch/torchtitan ``torchtitan/models/llama3/infra/parallelize.py`` @81c1243): save the outputs
  of the save list's ops, recompute the rest, with a per-call matmul counter that recomputes every
  second ``aten.mm``. The list's families are aten ops: ``matmul`` is ``aten.mm``; ``attention``
  the fused SDPA kernels (CUDA's flash, memory-efficient and cuDNN; on the CPU build the CPU flash
  kernel stands in for them, as CPU SDPA runs it); ``reduce_scatter`` the functional
  reduce-scatter of sequence parallelism.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from planner.plan.checkpointing import CheckpointPolicy, SavedOp, SaveList
from planner.plan.knobs import Knobs
from validate.reference_model import AttentionCore, Transformer

_ATEN = torch.ops.aten


def _saved_ops(save: SaveList) -> frozenset[Any]:
    """The aten ops whose outputs the list keeps."""
    families: dict[SavedOp, tuple[Any, ...]] = {
        SavedOp.MATMUL: (_ATEN.mm.default,),
        SavedOp.ATTENTION: (_ATEN._scaled_dot_product_flash_attention.default,
                            _ATEN._scaled_dot_product_efficient_attention.default,
                            _ATEN._scaled_dot_product_cudnn_attention.default,
                            _ATEN._scaled_dot_product_flash_attention_for_cpu.default),
        SavedOp.REDUCE_SCATTER: (torch.ops._c10d_functional.reduce_scatter_tensor.default,),
    }
    return frozenset(op for family in save.ops for op in families[family])


def selective_context_fn(save: SaveList) -> Callable[[], Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: torchtitan's per-op policy over
    ``save`` (a fresh matmul counter for every checkpointed call, forward and recompute apart)."""
    from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    saved = _saved_ops(save)
    mm = _ATEN.mm.default

    def context_fn() -> Any:
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
            if func == mm:
                meta[key] += 1
            keep = func in saved and not (func == mm and save.alternate_matmuls and meta[key] % 2 == 0)
            return TorchPolicy.MUST_SAVE if keep else TorchPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def apply_checkpointing(model: Transformer, knobs: Knobs) -> Transformer:
    """Checkpoint the planned blocks (and segments), each block with its policy (the plan's
    ``checkpoint_policy`` unless ``block_policies`` names another)."""
    overrides = knobs.policy_overrides
    policy_of = {b: overrides.get(b, knobs.checkpoint_policy) for b in knobs.checkpoint_blocks}
    cores = frozenset(b for b, p in policy_of.items() if p is CheckpointPolicy.ATTENTION)
    for index, block in enumerate(model.blocks):
        core = block.get_submodule("attn.core")
        assert isinstance(core, AttentionCore)
        core.checkpointed = index in cores
    model.set_checkpointing(frozenset(policy_of) - cores, tuple(knobs.checkpoint_segments))
    per_op = sorted(b for b, p in policy_of.items() if p is CheckpointPolicy.OPS)
    model.checkpoint_contexts = {b: selective_context_fn(knobs.save_list) for b in per_op}
    return model
