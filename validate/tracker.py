"""A live-storage tracker: the exact bytes real PyTorch code keeps alive, on any device, at any size.

Under ``FakeTensorMode`` no memory is used, but every aten op still produces tensors with
storages. ``LiveStorageTracker`` (a ``TorchDispatchMode``) records each new storage an op
produces, with its size rounded up to the CUDA caching allocator's 512-byte blocks, and a
``weakref.finalize`` on the storage object subtracts it when PyTorch frees it. The running
maximum is what ``torch.cuda.max_memory_allocated()`` would read for the same code.

Storages that exist before the tracker starts (parameters, buffers) are added with ``track``.
A wrapper subclass (DTensor: FSDP2's sharded parameters, gradients and Adam moments) is counted
through its inner tensors. As PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker``
does, an op on DTensors is handed back to DTensor first (``NotImplemented``), so the local ops it
desugars into (a redistribution's copies, loss_parallel's temporaries) are seen one by one;
DTensor's sharding propagation (``ShardingPropagator._propagate_tensor_meta_non_cached``: it
runs the op on fake tensors for their shapes, under the simulation's own fake mode when there is
one) is not counted; and under fake tensors ``wait_tensor`` returns its input, as it does on a
device (its fake kernel makes a new tensor). FSDP2 allocates and frees its unsharded buffers with
``UntypedStorage.resize_``, which bypasses
dispatch modes: while the tracker is active, ``resize_`` is wrapped so a tracked storage's size
follows it (and a storage first seen at size 0 is tracked when it grows).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

CUDA_BLOCK_BYTES = 512


def rounded_bytes(n_bytes: int, block_bytes: int = CUDA_BLOCK_BYTES) -> int:
    """Size the caching allocator hands out for a request of ``n_bytes`` (0 stays 0)."""
    return -(-n_bytes // block_bytes) * block_bytes if n_bytes > 0 else 0


@dataclass
class TraceEvent:
    """Live bytes right after one aten op (and the module it ran in, when known)."""

    op: str
    live_bytes: int
    module: str = ""


class LiveStorageTracker(TorchDispatchMode):
    """Counts live storage bytes op by op; ``peak_bytes`` is the maximum seen."""

    def __init__(self, block_bytes: int = CUDA_BLOCK_BYTES, record_trace: bool = False) -> None:
        super().__init__()
        self.block_bytes = block_bytes
        self.record_trace = record_trace
        self.live_bytes = 0
        self.peak_bytes = 0
        self.trace: list[TraceEvent] = []
        self.current_module = ""
        self._live: dict[int, int] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages that already exist (parameters, buffers, a data batch)."""
        for tensor in tensors:
            self._add(tensor)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        """Like ``torch.cuda.reset_peak_memory_stats``: the peak restarts from what is live now."""
        self.peak_bytes = self.live_bytes
        self.trace.clear()

    def _add(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            # a DTensor's own storage reports the global size and holds nothing; the memory is
            # its local shard (ops on it run inside the subclass's handler, unseen by this mode)
            attrs, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            for attr in attrs:
                inner = getattr(tensor, attr)
                if isinstance(inner, torch.Tensor):
                    self._add(inner)
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        n_bytes = rounded_bytes(storage.nbytes(), self.block_bytes)
        self._live[key] = n_bytes
        self.live_bytes += n_bytes
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size in place (FSDP2's resize_ to 0 and back)."""
        key = id(storage)
        n_bytes = rounded_bytes(storage.nbytes(), self.block_bytes)
        if key not in self._live:
            self._live[key] = 0
            weakref.finalize(storage, self._release, key)
        self.live_bytes += n_bytes - self._live[key]
        self._live[key] = n_bytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def __enter__(self) -> LiveStorageTracker:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        tracker = self
        self._propagating = 0
        propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def shapes_only(*args: Any, **kwargs: Any) -> Any:
            tracker._propagating += 1
            try:
                return propagate(*args, **kwargs)
            finally:
                tracker._propagating -= 1

        self._original_propagate = propagate
        ShardingPropagator._propagate_tensor_meta_non_cached = shapes_only  # type: ignore[method-assign]
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            result = original(storage, size)
            tracker._resized(storage)
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._propagate_tensor_meta_non_cached = self._original_propagate  # type: ignore[method-assign]
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor desugars it into local ops, which come back here
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            return args[0]
        out = func(*args, **(kwargs or {}))
        if self._propagating:  # DTensor's sharding propagation: shapes, not memory
            return out
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._add(item)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self.record_trace:
            self.trace.append(TraceEvent(str(func), self.live_bytes, self.current_module))
        return out
