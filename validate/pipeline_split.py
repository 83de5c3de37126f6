"""The reference model cut into pipeline stages, as torchtitan cuts its models.

torchtitan's ``pipeline_module_split`` (``torchtitan/distributed/pipeline_parallel.py``) builds
every stage as the whole model and deletes what the stage does not own: the token embedding
stays on the first stage, the final norm and the LM head on the last, each stage keeps its run
of blocks (under their original names); the loss is not part of any stage but the schedule's
``loss_fn`` on the last stage's output (the logits). ``StageModel`` is that, for
``validate.reference_model.Transformer``: it holds the owned submodules of a freshly built model
and runs them as ``Transformer.forward`` does (the rotary tables and the eager mask are rebuilt
by every stage, as torchtitan's stages each hold their own ``freqs_cis``), with a plan's
checkpointing on its blocks (``checkpoint_stage``: ``torch.utils.checkpoint`` units as
``validate.checkpoint`` applies them to the whole model) and, for a mixed policy, its forward
under ``torch.autocast`` (``StageModel.autocast``; the loss stays outside, fp32).

Stage ``s`` of ``pp * v`` lives on rank ``s % pp`` ("loop" style: GPipe, 1F1B, Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble) or, with v = 2, on rank ``s`` for ``s < pp`` and ``2pp-1-s``
after ("v" style: ZBVZeroBubble, DualPipeV), as
``torch/distributed/pipelining/_utils.py:generate_stage_to_rank_mapping`` assigns them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from planner.model.config import AttentionImpl, ModelConfig, PositionKind
from planner.plan.checkpointing import CheckpointPolicy
from planner.plan.knobs import Knobs
from validate.checkpoint import selective_context_fn
from validate.reference_model import AttentionCore, Transformer, build_model


def split_layers(n_layers: int, n_stages: int, layers_per_stage: tuple[int, ...] | None = None) -> list[range]:
    """The blocks of each stage: ``layers_per_stage`` if given, else an even split with the
    remainder on the earliest stages (torchtitan's default puts one more on the first stages too)."""
    if layers_per_stage is None:
        base, extra = divmod(n_layers, n_stages)
        layers_per_stage = tuple(base + (1 if s < extra else 0) for s in range(n_stages))
    if len(layers_per_stage) != n_stages or sum(layers_per_stage) != n_layers or min(layers_per_stage) < 0:
        raise ValueError(f"layers per stage {layers_per_stage} must be {n_stages} counts summing to {n_layers}")
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_indices(rank: int, pp: int, v: int, style: str) -> list[int]:
    """The stages rank ``rank`` runs, ascending (``_utils.py:generate_stage_to_rank_mapping``)."""
    if style == "v":
        if v != 2:
            raise ValueError("V-style schedules run exactly two stages per rank")
        return sorted((rank, 2 * pp - 1 - rank))
    return [rank + k * pp for k in range(v)]


class StageModel(nn.Module):
    """One stage: the embedding if first, its blocks, the final norm and LM head if last. Takes
    token ids (first stage) or the previous stage's hidden states; returns hidden states, or the
    logits on the last stage (the loss is the schedule's ``loss_fn``: ``pipeline_loss``)."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        if model.config.tie_embeddings and (first != last):
            raise ValueError("tied embeddings cannot be split across pipeline stages (torchtitan refuses them too)")
        if model.config.moe is not None:
            raise ValueError("the pipeline harness runs dense models only")
        self.config: ModelConfig = model.config
        self.embed = model.embed if first else None
        self.pos_embed = model.pos_embed if first else None
        self.embed_dropout = model.embed_dropout if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.final_norm = model.final_norm if last else None
        self.lm_head = model.lm_head if last else None
        self.autocast: torch.dtype | None = None  # the forward under torch.autocast in this dtype
        # checkpoint units first -> last (blocks run under one non-reentrant torch.utils.checkpoint), each
        # with ``checkpoint_contexts[first]`` as its context_fn if set: ``checkpoint_stage``
        self.checkpoint_units: dict[int, int] = {}
        self.checkpoint_contexts: dict[int, Callable[[], Any]] = {}

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return Transformer.rope_tables(self, positions, dtype)  # type: ignore[arg-type]

    def _masks(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.config.attention is not AttentionImpl.EAGER:
            return None, None
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)
        window = None
        if any(b.windowed for b in self.blocks.values()) and self.config.sliding_window is not None:
            window = causal | torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril(
                -self.config.sliding_window)
        return causal, window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return self._forward(x)
        with torch.autocast(x.device.type, dtype=self.autocast):
            return self._forward(x)

    def _run_blocks(self, first: int, last: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                    masks: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
        for index in range(first, last + 1):
            block = self.blocks[str(index)]
            x = block(x, rope, masks[1] if block.windowed else masks[0])
        return x

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[1]
        if self.embed is not None:
            x = self.embed(x)
            if self.config.scale_embeddings:  # Gemma: times sqrt(D), as Transformer.forward
                x = x * self.config.d_model ** 0.5
            if self.pos_embed is not None:
                x = x + self.pos_embed(torch.arange(seq_len, device=x.device))
            if self.embed_dropout is not None:
                x = self.embed_dropout(x)
        rope = None
        if self.config.positions is PositionKind.ROTARY and len(self.blocks):
            rope = self.rope_tables(torch.arange(seq_len, device=x.device, dtype=torch.float32), x.dtype)
        causal, window = self._masks(seq_len, x.device)
        indices = [int(i) for i in self.blocks]
        at = 0
        while at < len(indices):  # as ``Transformer.forward`` runs its blocks and checkpoint units
            first = indices[at]
            last = self.checkpoint_units.get(first, first)
            if first in self.checkpoint_units:
                windowed = [self.blocks[str(i)].windowed for i in range(first, last + 1)]
                masks = (causal if not all(windowed) else None, window if any(windowed) else None)
                context = self.checkpoint_contexts.get(first)
                extra = {"context_fn": context} if context is not None else {}
                x = torch.utils.checkpoint.checkpoint(self._run_blocks, first, last, x, rope, masks,
                                                      use_reentrant=False, **extra)
            else:
                x = self._run_blocks(first, first, x, rope, (causal, window))
            at += last - first + 1
        if self.lm_head is not None and self.final_norm is not None:
            x = Transformer._logits(self, x)  # type: ignore[arg-type]  # soft-capped where Gemma 2 caps them
        return x


def checkpoint_stage(model: StageModel, knobs: Knobs) -> None:
    """A plan's checkpointing on the stage's blocks, as ``validate.checkpoint.apply_checkpointing``
    applies it to the whole model: each planned block (and segment) with its policy."""
    overrides = knobs.policy_overrides
    policy_of = {b: overrides.get(b, knobs.checkpoint_policy) for b in knobs.checkpoint_blocks}
    cores = {b for b, p in policy_of.items() if p is CheckpointPolicy.ATTENTION}
    for index, block in model.blocks.items():
        core = block.get_submodule("attn.core")
        assert isinstance(core, AttentionCore)
        core.checkpointed = int(index) in cores
    units = {(b, b) for b in policy_of if b not in cores} | set(knobs.checkpoint_segments)
    owned = {int(i) for i in model.blocks}
    model.checkpoint_units = {first: last for first, last in sorted(units) if first in owned}
    model.checkpoint_contexts = {b: selective_context_fn(knobs.save_list) for b, p in policy_of.items()
                                 if p is CheckpointPolicy.OPS and b in owned}


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference model's loss on the last stage's logits: fp32 mean cross-entropy."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_stage_models(config: ModelConfig, dtype: torch.dtype, n_stages: int, indices: list[int],
                       layers_per_stage: tuple[int, ...] | None = None, seed: int = 0) -> list[StageModel]:
    """The stage modules of ``indices``: each from a whole model built in ``dtype`` (seeded, so
    every stage of one run holds the same weights it would in a full model) with the rest dropped."""
    ranges = split_layers(config.n_layers, n_stages, layers_per_stage)
    stages = []
    for index in indices:
        torch.manual_seed(seed)
        model = build_model(config, dtype)
        stages.append(StageModel(model, ranges[index], index == 0, index == n_stages - 1))
        del model  # the parts no stage holds are freed with it
    return stages
