"""Apply a plan to the reference model, in one place: precision, checkpointing, optimizer, loop.

- precision: parameters are created in the policy's dtype (fp32, or bf16 for bf16-true); the
  mixed policies run the forward under ``torch.autocast`` (bf16 or fp16) and fp16-mixed scales
  the loss with a ``GradScaler``; tf32 enables TF32 matmuls;
- checkpointing: ``torch.utils.checkpoint`` (non-reentrant) on exactly the planned blocks and
  segments;
- optimizer: ``torch.optim.AdamW`` / ``SGD`` with ``foreach`` or ``fused`` as planned;
- one optimizer step = ``grad_accum_steps`` micro-batches, each loss scaled by 1/steps, then
  ``step()`` and ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from planner.config import OptimizerImpl, OptimizerKind, TrainConfig
from planner.knobs import Knobs
from planner.precision import PrecisionSpec
from validate.reference_model import Transformer

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def param_dtype(spec: PrecisionSpec) -> torch.dtype:
    return TORCH_DTYPES[spec.param_dtype.value]


def configure_model(model: Transformer, knobs: Knobs) -> Transformer:
    model.set_checkpointing(frozenset(knobs.checkpoint_blocks), tuple(knobs.checkpoint_segments))
    model.train()
    return model


def make_optimizer(model: torch.nn.Module, training: TrainConfig) -> torch.optim.Optimizer:
    fused = training.optimizer_impl == OptimizerImpl.FUSED
    params = list(model.parameters())
    if training.optimizer == OptimizerKind.ADAMW:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=training.weight_decay,
                                 fused=fused or None, foreach=not fused or None)
    momentum = 0.9 if training.optimizer == OptimizerKind.SGD_MOMENTUM else 0.0
    return torch.optim.SGD(params, lr=1e-3, momentum=momentum, weight_decay=0.0,
                           fused=fused or None, foreach=not fused or None)


@contextmanager
def precision_context(spec: PrecisionSpec, device_type: str) -> Iterator[None]:
    """The forward's numeric context: autocast for the mixed policies, TF32 for tf32."""
    if spec.autocast_dtype is not None:
        with torch.autocast(device_type, dtype=TORCH_DTYPES[spec.autocast_dtype.value]):
            yield
    elif spec.policy.value == "tf32" and device_type == "cuda":
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    else:
        yield


def make_scaler(spec: PrecisionSpec, device_type: str) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(device_type) if spec.loss_scaling else None


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    knobs: Knobs,
    spec: PrecisionSpec,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """One optimizer step over ``grad_accum_steps`` micro-batches sliced from the batch."""
    b = knobs.micro_batch_size
    device_type = input_ids.device.type
    for micro in range(knobs.grad_accum_steps):
        rows = slice(micro * b, (micro + 1) * b)
        with precision_context(spec, device_type):
            loss = model(input_ids[rows], targets[rows]) / knobs.grad_accum_steps
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        del loss
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
