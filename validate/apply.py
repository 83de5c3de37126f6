"""Apply a plan to the reference model, in one place: precision, checkpointing, optimizer, loop.

- precision: parameters are created in the policy's dtype (fp32, or bf16 for bf16-true); the
  mixed policies run the forward under ``torch.autocast`` (bf16 or fp16) and fp16-mixed scales
  the loss with a ``GradScaler``; tf32 enables TF32 matmuls;
- checkpointing: ``torch.utils.checkpoint`` (non-reentrant) on exactly the planned blocks and
  segments;
- optimizer: ``torch.optim.AdamW`` / ``SGD`` with ``foreach`` or ``fused`` as planned;
- one optimizer step = ``grad_accum_steps`` micro-batches, each loss scaled by 1/steps, then
  ``step()`` and ``zero_grad(set_to_none=True)``;
- ZeRO-2/3: FSDP2 ``fully_shard`` per block and on the model (``shard_model``); gradients are
  reduce-scattered after every micro-batch and freed by ``zero_grad(set_to_none=True)``;
- several GPUs (``data_parallel`` > 1): ZeRO-0 wraps the model in
  ``DistributedDataParallel(gradient_as_bucket_view=True)``, ZeRO-1 also shards the optimizer
  with ``ZeroRedundancyOptimizer``; every micro-batch but the last runs under ``no_sync()`` and
  the gradients are zeroed in place (``set_to_none=False``), so they stay views of DDP's buckets:
  with ``set_to_none=True`` the ``no_sync`` micro-batches would allocate a second set of
  gradients beside the buckets (measured).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from planner.model.config import OptimizerImpl, OptimizerKind, TrainConfig
from planner.plan.knobs import GradSync, Knobs
from planner.plan.parallel_dims import Sharding
from planner.precision import PrecisionSpec
from validate.checkpoint import apply_checkpointing
from validate.parallelize import loss_context
from validate.reference_model import Transformer

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def param_dtype(spec: PrecisionSpec) -> torch.dtype:
    return TORCH_DTYPES[spec.param_dtype.value]


def configure_model(model: Transformer, knobs: Knobs) -> Transformer:
    apply_checkpointing(model, knobs)
    model.train()
    return model


def _optimizer_args(training: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    fused = training.optimizer_impl == OptimizerImpl.FUSED
    impl: dict[str, Any] = {"fused": fused or None, "foreach": not fused or None}
    if training.optimizer == OptimizerKind.ADAMW:
        return torch.optim.AdamW, {"lr": 1e-4, "weight_decay": training.weight_decay, **impl}
    momentum = 0.9 if training.optimizer == OptimizerKind.SGD_MOMENTUM else 0.0
    return torch.optim.SGD, {"lr": 1e-3, "momentum": momentum, "weight_decay": 0.0, **impl}


def make_optimizer(model: torch.nn.Module, training: TrainConfig,
                   sharding: Sharding | None = None) -> torch.optim.Optimizer:
    """The planned optimizer; with ZeRO-1 (``Sharding.OPTIMIZER``), a ZeroRedundancyOptimizer around it."""
    cls, kwargs = _optimizer_args(training)
    if sharding is Sharding.OPTIMIZER:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=cls, **kwargs)
    return cls(list(model.parameters()), **kwargs)


def wrap_data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP with the gradients as views of its all-reduce buckets (one copy of them, not two)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def shard_model(model: Transformer, knobs: Knobs, spec: PrecisionSpec, mesh: Any, experts_mesh: Any = None
                ) -> Transformer:
    """ZeRO-2/3 as FSDP2: ``fully_shard`` every block (under expert parallelism its experts first,
    over ``experts_mesh``), then the model (the root: embedding, final norm, head), each with ``reshard_after_forward`` for ``Sharding.FULL`` (ZeRO-3). A mixed policy becomes a
    ``MixedPrecisionPolicy(param_dtype=<autocast dtype>, reduce_dtype=fp32)``: the forward then
    runs on gathered low-precision parameters without autocast (``step_spec``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = knobs.parallel.sharding is Sharding.FULL
    kwargs: dict[str, Any] = {}
    if spec.autocast_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[spec.autocast_dtype.value],
                                                   reduce_dtype=torch.float32)
    from torch.distributed.tensor import Shard

    # stacked expert weights (E, in, out) along dim 1: E is often below the shard degree
    kwargs["shard_placement_fn"] = lambda param: Shard(1) if param.dim() == 3 else None
    for block in model.blocks:
        experts = getattr(block.mlp, "experts", None)
        if experts_mesh is not None and experts is not None:
            # expert parallelism: a rank's experts are their own unit over the ranks holding the
            # same ones (torchtitan's apply_fsdp: fully_shard(experts, mesh=dp_mod_ep) first)
            fully_shard(experts, mesh=experts_mesh, reshard_after_forward=reshard, **kwargs)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    return model


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor (the wrapped optimizer's, for ZeroRedundancyOptimizer)."""
    inner = getattr(optimizer, "optim", optimizer)
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


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


@contextmanager
def sequence_context(mesh: Any, input_ids: torch.Tensor) -> Iterator[torch.Tensor | None]:
    """Context parallelism's micro-batch context over ``mesh`` (yielding this rank's token
    positions), or nothing (None) without it."""
    if mesh is None:
        yield None
        return
    from validate.context import micro_batch_context

    with micro_batch_context(mesh, input_ids.shape[1] * mesh.size(), input_ids.device) as positions:
        yield positions


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
    keep_grads: bool | None = None,
    context: Any = None,
) -> None:
    """One optimizer step over ``grad_accum_steps`` micro-batches sliced from the batch.

    ``keep_grads`` zeroes the gradients in place instead of freeing them (default: under DDP).
    DDP reduces on the last micro-batch only (``no_sync`` on the others); FSDP2 after every one,
    or with ``fsdp_grad_sync`` "last" only after the last (``set_requires_gradient_sync``).
    ``context`` is the context-parallel mesh: the batch is this rank's sequence shard
    (``validate.context.shard_batch``) and each micro-batch runs as ring attention."""
    b = knobs.micro_batch_size
    device_type = input_ids.device.type
    ddp = hasattr(model, "no_sync")
    fsdp_once = knobs.fsdp_grad_sync is GradSync.LAST and hasattr(model, "set_requires_gradient_sync")
    for micro in range(knobs.grad_accum_steps):
        rows = slice(micro * b, (micro + 1) * b)
        final = micro == knobs.grad_accum_steps - 1
        if fsdp_once:
            model.set_requires_gradient_sync(final)  # type: ignore[operator]
        sync = model.no_sync() if ddp and not final else contextlib.nullcontext()  # type: ignore[operator]
        with sync, loss_context(knobs), sequence_context(context, input_ids) as positions:
            with precision_context(spec, device_type):
                loss = model(input_ids[rows], targets[rows], positions) / knobs.grad_accum_steps
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
    optimizer.zero_grad(set_to_none=not (ddp if keep_grads is None else keep_grads))
