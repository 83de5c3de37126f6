"""Context parallelism applied to the reference model as torch's ``context_parallel`` runs it
(``torch.distributed.tensor.experimental``, as torchtitan's ``train.py`` uses it).

Every rank of a context-parallel group holds two chunks of each sequence (torch's head-tail load
balancer: of 2 cp chunks, rank r holds chunk r and chunk 2 cp - 1 - r), so causal attention costs
every rank the same. ``shard_batch`` shards a step's token ids and targets that way once, as a
context-parallel data loader hands them out (``no_restore_buffers``: the storage keeps its size,
as in place ``resize_`` leaves it); each micro-batch then runs inside ``micro_batch_context``,
which shards the tokens' positions (the rotary tables are built from them) and lets torch's
dispatcher run every SDPA call as ring attention: the rank's queries against every rank's keys
and values, gathered once (``_RotateMethod.ALL_GATHER``, the default), the output merged by
log-sum-exp, key/value gradients passed round the ring (all-to-all).

On the CPU build torch's dispatcher knows only the CUDA kernels (flash, memory-efficient,
cuDNN); ``ring_attention_on_cpu`` registers the CPU flash kernel with the same ring templates
(``_templated_ring_attention`` and its backward) and a Shard(2) sharding rule, so fake and gloo
runs execute torch's own ring: its buffers, its merge, its collectives (measured equal to
unsharded attention on 2 gloo ranks: output and q/k/v gradients).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

_ATEN = torch.ops.aten


def _ring_modules() -> tuple[Any, Any]:
    from torch.distributed.tensor.experimental._context_parallel import _attention, _sharding_rules

    return _attention, _sharding_rules


def _cpu_forward_strategy(op_schema: Any) -> Any:
    """output, logsumexp, q, k, v all sharded on the sequence dimension (torch's CP rule for flash)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(2)] * 5], input_index=2)


def _cpu_backward_strategy(op_schema: Any) -> Any:
    """grad q/k/v, grad_out, q, k, v, out, logsumexp sharded on the sequence dimension."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(2)] * 9], input_index=3)


def _cpu_ring_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch's ``_sdpa_handler`` for the CPU flash kernel: propagate the Shard(2) rule, run the
    ring on the local shards, wrap the results."""
    from torch.distributed.tensor import DTensor

    attention, _ = _ring_modules()
    forward = _ATEN._scaled_dot_product_flash_attention_for_cpu.default
    backward = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(info)
    assert info.output_sharding is not None
    group = info.compute_mesh.get_group()
    local, scale = info.local_args, info.local_kwargs.get("scale")
    if op_call is forward:
        query, key, value = local[:3]
        dropout_p, is_causal = (local[3] if len(local) > 3 else 0.0), (local[4] if len(local) > 4 else False)
        results = attention._templated_ring_attention(group, 2, forward, query=query, key=key, value=value,
                                                       is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = local[:8]
        results = attention._templated_ring_attention_backward(
            group, 2, backward, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value,
            out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    return DTensor._op_dispatcher.wrap(tuple(results), info.output_sharding.output_spec)


@contextmanager
def ring_attention_on_cpu() -> Iterator[None]:
    """While open, context parallelism runs the CPU flash kernel as torch's ring attention."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    attention, rules = _ring_modules()
    forward = _ATEN._scaled_dot_product_flash_attention_for_cpu.default
    backward = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default
    handlers = {forward: _cpu_ring_handler, backward: _cpu_ring_handler}
    with ExitStack() as stack:
        stack.enter_context(rules._op_strategy_context(forward, _cpu_forward_strategy, RuntimeSchemaInfo(3)))
        stack.enter_context(rules._op_strategy_context(backward, _cpu_backward_strategy, None))
        attention.custom_ops.update(handlers)
        try:
            yield
        finally:
            for op in handlers:
                attention.custom_ops.pop(op, None)


def shard_batch(mesh: Any, *batches: torch.Tensor) -> None:
    """Shard (rows, T) token tensors in place along the sequence, load-balanced, as a
    context-parallel data loader hands them to this rank (their storage keeps its size)."""
    from torch.distributed.tensor.experimental import context_parallel

    with context_parallel(mesh, buffers=list(batches), buffer_seq_dims=[1] * len(batches),
                          no_restore_buffers=set(batches)):
        pass


@contextmanager
def micro_batch_context(mesh: Any, seq_len: int, device: torch.device) -> Iterator[torch.Tensor]:
    """One micro-batch under context parallelism: yields this rank's token positions (fp32, for
    the rotary tables) while SDPA runs as ring attention over ``mesh``."""
    from torch.distributed.tensor.experimental import context_parallel

    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
        yield positions
