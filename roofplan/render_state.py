"""The napkin math of the memory table's model-state rows where a rank's gradients are not its
parameters' shape: DTensor writes a vocabulary-parallel embedding's gradient whole, (V, D), on
every tensor-parallel rank (``planner.parallel.tensor._vocab_rows``), so a rank holds more
gradient elements than parameters until the optimizer step slices it; and the title's note of what
a fine-tuning plan trains (``trained_label``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hardware.units import format_count
from planner.finetune.config import FinetuneMethod
from planner.model.config import ModelConfig
from planner.parallel.expert import shard_experts
from planner.parallel.tensor import rank_description
from planner.plan.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from planner.program.results import PlanResult


def rank_gradient_count(model: ModelConfig, dims: ParallelDims, shown: str) -> str:
    """The gradients row's count for one tensor-/expert-parallel rank: ``shown`` (its parameters,
    as the parameters row writes them) when the gradients have the parameters' shape, else the
    gradient elements it holds and why."""
    if dims.tp == 1 and dims.ep == 1:
        return shown
    desc = shard_experts(rank_description(model, dims.tp, dims.sp, 1), dims.ep, 1)
    params = sum(p.numel for p in desc.params.values())
    grads = sum(p.grad_elements for p in desc.params.values())
    if grads == params:
        return shown
    return (f"({shown} + {format_count(grads - params)} of the vocabulary-parallel embedding's gradient, whole on "
            f"every rank as DTensor writes it)")


_METHOD_LABEL = {FinetuneMethod.LORA: "LoRA", FinetuneMethod.QLORA: "QLoRA"}


def trained_label(result: PlanResult) -> str:
    """A fine-tuning plan's trained share: ``, 3.41M trained: LoRA r 8 on q_proj, v_proj``."""
    ft, trained = result.model.config.finetune, result.model.n_trainable_params
    if ft is None or trained is None:
        return ""
    return (f", {format_count(trained)} trained: {_METHOD_LABEL[ft.method]} r {ft.rank} on "
            f"{', '.join(ft.target_modules)}; the frozen base runs forward and input gradients only")
