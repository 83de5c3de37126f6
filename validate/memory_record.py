"""What ``validate --memory-snapshot`` / ``--trace`` / ``--compare`` record of a measured step.

``MemoryRecorder`` follows the live-storage tracker (``validate.tracker``) through one measured
step: every storage it counts becomes an allocation and every storage it lets go a free, written
in torch's snapshot format by the writer ``plan --memory-snapshot`` uses
(``planner.memory.snapshot_format``), each labelled with the module and category it belongs to
in the planner's terms (``planner.memory.types.Category``), so ``validate --compare`` can set the
two side by side.

Where an allocation happened:

- forward (and a checkpoint's recompute): the innermost module running, from forward pre / post
  hooks on every module (names as ``net.named_modules()``: ``blocks.3.mlp.up_proj``; ``""`` the
  model's own code: the rotary tables, the logits' fp32 cast, the loss);
- backward: the autograd node running (``torch._C._current_autograd_node()``) carries its module in
  its ``metadata`` dict, written by the forward post hook on every node the module's forward
  created (from its outputs' ``grad_fn`` back to its inputs'; the innermost module writes first).
  Nothing is kept alive by it: the walk holds nodes only while it runs;
- the optimizer step (``register_step_pre_hook`` / ``register_step_post_hook``): ``optimizer.step``.

(pytorch/pytorch v2.13: ``torch/autograd/graph.py`` ``Node.metadata``, ``torch/csrc/Module.cpp``
``_current_autograd_node``, ``torch/optim/optimizer.py`` the step hooks.)

Categories, as the planner's walk counts them (``planner/memory/walk.py``): what exists when the
step starts is parameters and buffers, optimizer state, or data (the token and target batch);
forward allocations are activations, but an autocast copy of a parameter (``_to_copy`` of a
parameter's storage) and whatever is freed before the module call that allocated it returns
are temporaries, and the LM head's and the loss's are logits; backward allocations are
temporaries (activation gradients), the model's own code's are logits (the loss's and the cast's
gradients), as are those between the phases (the loss divided by the accumulation count, the
backward's seed gradient: the walk's ``loss`` op counts them), and a storage that is a parameter's ``.grad`` when the optimizer steps is gradients
(its module the parameter's); the optimizer step's are temporaries, or optimizer state if they
outlive it.

The trace (``--trace`` under ``--mode simulate``): fake tensors take no time, so its clock counts
aten ops (1 µs is one op); each span is a run of ops in one module, phase and micro-batch, and a
counter track gives the allocated bytes after every op.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from planner.memory.snapshot_format import OPTIMIZER_STEP, Block, SnapshotHeap, snapshot_dict
from planner.memory.types import Category, Phase
from validate.tracker import LiveStorageTracker

SOURCE = "measured"  # every frame's filename starts with it: measured/<category>
HEAD_MODULE = "lm_head"  # the reference model's LM head: it and the loss after it are logits
_MODULE_KEY = "roofplan_module"  # the autograd node metadata entry naming its module
_TO_COPY = torch.ops.aten._to_copy.default


@dataclass(frozen=True)
class OpTick:
    """One aten op of the recorded step: where it ran and the allocated bytes after it."""

    phase: Phase | None  # None: between the phases (gradient scaling, zero_grad)
    micro_batch: int
    module: str
    allocated_bytes: int


class _RecordingTracker(LiveStorageTracker):
    """The live-storage tracker, telling its recorder of every storage it counts and lets go."""

    def __init__(self, recorder: MemoryRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def _add(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            super()._add(tensor)  # comes back here for each inner tensor
            return
        key = id(tensor.untyped_storage())
        known = key in self._live
        super()._add(tensor)
        if not known:
            self.recorder.allocated(key, self._live[key])

    def _release(self, key: int) -> None:
        super()._release(key)
        self.recorder.freed(key)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        before = self._live.get(key, 0)
        super()._resized(storage)
        if self._live[key] != before:
            self.recorder.freed(key)
            self.recorder.allocated(key, self._live[key])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.recorder.start_op(func, args)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.recorder.end_op(self.live_bytes)
        return out


@dataclass(eq=False)
class _Alloc:
    block: Block
    phase: Phase | None
    call: int  # the module call it was allocated in (0: none but the model's own code)


class MemoryRecorder:
    """Records one measured step: ``tracker()`` replaces the step's live-storage tracker,
    ``begin`` (after the warm-up, the peak reset) and ``end`` bracket the step."""

    def __init__(self) -> None:
        self.heap = SnapshotHeap()
        self.ticks: list[OpTick] = []
        self.module_names: frozenset[str] = frozenset()
        self._tracker: _RecordingTracker | None = None
        self._recording = False
        self._allocs: dict[int, _Alloc] = {}
        self._stack: list[tuple[str, int]] = []  # (module, call id), innermost last
        self._calls = 0
        self._micro_batch = -1
        self._head_done = False
        self._in_optimizer = False
        self._op = ""
        self._weight_copy = False
        self._param_keys: frozenset[int] = frozenset()
        self._handles: list[Any] = []
        self._step: tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]] | None = None
        # a real run's own files instead of the tracker's: torch.profiler's trace (run mode) and,
        # on a GPU, torch.cuda.memory._snapshot() (no module or category: --compare refuses it)
        self.profiler_trace: dict[str, Any] | None = None
        self.device_snapshot: dict[str, Any] | None = None

    def tracker(self) -> LiveStorageTracker:
        self._tracker = _RecordingTracker(self)
        return self._tracker

    @property
    def peak_bytes(self) -> int:
        return self.heap.peak_bytes

    # --- the step ------------------------------------------------------------------------------

    def attach(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Iterable[torch.Tensor]) -> None:
        """The model, optimizer and batch of the step to record (before ``begin``)."""
        self._step = (net, optimizer, list(data))

    def begin(self) -> None:
        """Start recording: what is live now is the step's start (parameters, state, data)."""
        from validate.apply import optimizer_state

        if self._tracker is None or self._step is None:
            raise RuntimeError("MemoryRecorder.begin: attach the step and track it with MemoryRecorder.tracker()")
        net, optimizer, data = self._step
        params = [*net.parameters(), *net.buffers()]
        self._param_keys = frozenset(id(t.untyped_storage()) for t in params)
        start = {**{id(t.untyped_storage()): Category.DATA for t in data},
                 **{id(t.untyped_storage()): Category.OPTIMIZER for t in optimizer_state(optimizer)},
                 **dict.fromkeys(self._param_keys, Category.PARAMS)}
        for key, n_bytes in self._tracker._live.items():
            if n_bytes:
                category = start.get(key, Category.TEMPORARIES)
                block = self.heap.alloc(n_bytes, category, "", f"start ({category.value} before the step)")
                self._allocs[key] = _Alloc(block, None, 0)
        self.module_names = frozenset(name for name, _ in net.named_modules())
        for name, module in net.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True,
                                                              always_call=True))
        self._handles.append(optimizer.register_step_pre_hook(self._optimizer_pre_hook(net)))
        self._handles.append(optimizer.register_step_post_hook(self._optimizer_post_hook))
        self._recording = True

    def end(self) -> None:
        """Stop recording (later frees are not the step's); what the optimizer step allocated and
        kept is optimizer state."""
        self._recording = False
        self._step = None  # holds no tensors past the step
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for alloc in self._allocs.values():
            if alloc.phase is Phase.OPTIMIZER:
                alloc.block.category = Category.OPTIMIZER

    # --- the tracker's callbacks ---------------------------------------------------------------

    def start_op(self, func: Any, args: Any) -> None:
        self._op = str(func)
        first = args[0] if args else None
        self._weight_copy = (func is _TO_COPY and isinstance(first, torch.Tensor)
                             and not is_traceable_wrapper_subclass(first)
                             and id(first.untyped_storage()) in self._param_keys)

    def end_op(self, allocated_bytes: int) -> None:
        if self._recording:
            phase, module = self._where()
            self.ticks.append(OpTick(phase, self._micro_batch, module, allocated_bytes))

    def allocated(self, key: int, n_bytes: int) -> None:
        if not self._recording or n_bytes <= 0:
            return
        phase, module = self._where()
        category = self._category(phase, module)
        when = phase.value if phase is not None else "between phases"
        if phase is not Phase.OPTIMIZER and phase is not None:
            when += f", micro-batch {self._micro_batch + 1}"
        block = self.heap.alloc(n_bytes, category, module, f"{module or '(model)'}: {self._op} [{when}]")
        self._allocs[key] = _Alloc(block, phase, self._stack[-1][1] if len(self._stack) > 1 else 0)

    def freed(self, key: int) -> None:
        alloc = self._allocs.pop(key, None) if self._recording else None
        if alloc is None:
            return
        momentary = alloc.call and any(call == alloc.call for _, call in self._stack)
        if momentary and alloc.phase in (Phase.FORWARD, Phase.RECOMPUTE) and alloc.block.category is Category.ACTIVATIONS:
            alloc.block.category = Category.TEMPORARIES
        self.heap.release(alloc.block)

    # --- where and what ------------------------------------------------------------------------

    def _where(self) -> tuple[Phase | None, str]:
        if self._in_optimizer:
            return Phase.OPTIMIZER, OPTIMIZER_STEP
        backward = torch._C._current_graph_task_id() != -1
        if self._stack:
            return (Phase.RECOMPUTE if backward else Phase.FORWARD), self._stack[-1][0]
        if backward:
            node = torch._C._current_autograd_node()
            return Phase.BACKWARD, (node.metadata.get(_MODULE_KEY, "") if node is not None else "")
        return None, ""

    def _category(self, phase: Phase | None, module: str) -> Category:
        if phase in (Phase.FORWARD, Phase.RECOMPUTE):
            if self._weight_copy:
                return Category.TEMPORARIES
            if module == HEAD_MODULE or (module == "" and self._head_done):
                return Category.LOGITS
            return Category.ACTIVATIONS
        if (phase is Phase.BACKWARD and module == "") or phase is None:
            return Category.LOGITS
        return Category.TEMPORARIES

    # --- hooks ---------------------------------------------------------------------------------

    def _pre_hook(self, name: str) -> Any:
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            if not self._stack and torch._C._current_graph_task_id() == -1:  # the model's forward: a micro-batch
                self._micro_batch += 1
                self._head_done = False
            self._calls += 1
            self._stack.append((name, self._calls))
        return hook

    def _post_hook(self, name: str) -> Any:
        def hook(_module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self._stack and self._stack[-1][0] == name:
                self._stack.pop()
            if name == HEAD_MODULE:
                self._head_done = True
            _label_nodes(name, output, (*args, *kwargs.values()))
        return hook

    def _optimizer_pre_hook(self, net: torch.nn.Module) -> Any:
        def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            # every name of a tied parameter, the last registered winning: the planner credits the
            # shared gradient to the LM head, which uses the embedding's weight
            for name, param in net.named_parameters(remove_duplicate=False):
                alloc = self._allocs.get(id(param.grad.untyped_storage())) if param.grad is not None else None
                if alloc is not None:
                    alloc.block.category = Category.GRADS
                    alloc.block.module = name.rpartition(".")[0]
            self._in_optimizer = True
        return hook

    def _optimizer_post_hook(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._in_optimizer = False

    # --- the files -----------------------------------------------------------------------------

    @property
    def recorded(self) -> bool:
        """Whether a step was recorded (not when it ran out of memory first)."""
        return self.device_snapshot is not None or bool(self.heap.history)

    @property
    def attributed(self) -> bool:
        """Whether the allocations were recorded with their module and category (not on a GPU)."""
        return self.device_snapshot is None and bool(self.heap.history)

    def snapshot(self) -> dict[str, Any]:
        """The recorded step in torch's snapshot format (``torch.cuda.memory._snapshot()``'s dict):
        on a GPU torch's own, else the tracker's allocations."""
        return self.device_snapshot if self.device_snapshot is not None else snapshot_dict(self.heap, SOURCE)

    def live_at_peak(self) -> list[Block]:
        return self.heap.live_at_peak()

    def trace(self, title: str) -> dict[str, Any]:
        """The recorded step as a Chrome / Perfetto trace: ``torch.profiler``'s in run mode, else
        module spans whose clock counts aten ops (see the module docstring)."""
        if self.profiler_trace is not None:
            return self.profiler_trace
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "measured step (fake tensors)"}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "aten ops by module"}}]
        start = 0
        for i, tick in enumerate(self.ticks):
            events.append({"name": "allocated bytes", "ph": "C", "ts": i + 1, "pid": 0,
                           "args": {"bytes": tick.allocated_bytes}})
            following = self.ticks[i + 1] if i + 1 < len(self.ticks) else None
            key = (tick.phase, tick.micro_batch, tick.module)
            if following is None or (following.phase, following.micro_batch, following.module) != key:
                phase = tick.phase.value if tick.phase is not None else "between phases"
                events.append({"name": tick.module or "(model)", "cat": phase, "ph": "X", "ts": start, "dur": i + 1 - start,
                               "pid": 0, "tid": 1, "args": {"aten_ops": i + 1 - start, "micro_batch": tick.micro_batch}})
                start = i + 1
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "otherData": {"title": title, "source": "validate --mode simulate: measured under fake tensors",
                              "clock": "timestamps count aten ops (1 us = one op): fake tensors take no time",
                              "peak_allocated_bytes": self.heap.peak_bytes}}


def _label_nodes(module: str, output: Any, inputs: tuple[Any, ...]) -> None:
    """Name ``module`` in the metadata of every autograd node its forward created: from its
    outputs' ``grad_fn`` back to its inputs' (a node already named keeps its inner module)."""
    from torch.utils._pytree import tree_flatten

    stops = [t.grad_fn for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    todo = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stop_ids = {id(n) for n in stops}
    seen: list[Any] = []  # held while walking: ids stay unique
    seen_ids: set[int] = set()
    while todo:
        node = todo.pop()
        if id(node) in stop_ids or id(node) in seen_ids:
            continue
        seen.append(node)
        seen_ids.add(id(node))
        node.metadata.setdefault(_MODULE_KEY, module)
        todo.extend(n for n, _ in node.next_functions if n is not None)
