"""PyTorch's allocator snapshot format, written from a list of allocations and frees (no torch).

One writer for both sides of ``validate --compare``: the predicted walk (``roofplan.export_snapshot``,
``plan --memory-snapshot``) and what ``validate --mode simulate`` measured
(``validate.memory_record``). The file is the dict ``torch.cuda.memory._snapshot()`` returns
(torch 2.13, ``torch/cuda/memory.py`` ``_snapshot`` and ``torch/cuda/_memory_viz.py``, which
reads it), pickled as ``torch.cuda.memory._dump_snapshot`` does:

- ``device_traces[0]``: the actions in order: ``alloc``, then ``free_requested`` and
  ``free_completed`` (as torch's caching allocator records them), each with ``addr``, ``size``,
  ``stream`` 0 and ``frames``; a frame is ``{filename, line, name}``: here ``<source>/<category>``,
  0 and where it happened (no Python stacks: the op or module, phase and micro-batch);
- ``segments``: one segment holding what is still allocated at the end (``active_allocated``
  blocks) and the gaps (``inactive``), its ``total_size`` the highest address reached, rounded up
  to the caching allocator's 2 MiB large segments.

Addresses come from a first-fit allocator over that one segment: neither the walk nor fake
tensors have addresses, and no caching-allocator rounding is added (both sides' sizes are already
rounded to 512 B). A block's category can change after it was allocated (a measured storage is
known to be a gradient only once the backward has made it one): frames are written at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner.memory.types import Category

BASE_ADDRESS = 0x7F0000000000
SEGMENT_ALIGN_BYTES = 2 << 20  # the caching allocator's large segments are multiples of 2 MiB
ALLOC, FREE_REQUESTED, FREE_COMPLETED = "alloc", "free_requested", "free_completed"
OPTIMIZER_STEP = "optimizer.step"  # the optimizer step's op, as planner/memory/step.py's walk observes it


@dataclass(eq=False)
class Block:
    """One allocation: its place, its size, and what it is (category, module, when)."""

    addr: int
    size: int
    category: Category
    module: str  # the op or module it was allocated in ("" for the whole model)
    where: str  # the frame's name: what allocated it, phase, micro-batch

    def frames(self, source: str) -> list[dict[str, Any]]:
        return [{"filename": f"{source}/{self.category.value}", "line": 0, "name": self.where}]


@dataclass
class SnapshotHeap:
    """First-fit addresses over one segment, the live blocks and the history of actions."""

    free: list[tuple[int, int]] = field(default_factory=lambda: [(BASE_ADDRESS, 1 << 60)])  # (addr, size), by addr
    live: dict[int, Block] = field(default_factory=dict)  # by address, in allocation order
    history: list[tuple[bool, Block]] = field(default_factory=list)  # (allocated, block): False is a free
    top: int = BASE_ADDRESS
    allocated_bytes: int = 0
    peak_bytes: int = 0
    peak_index: int = 0  # actions in ``history`` up to and including the first peak

    def alloc(self, size: int, category: Category, module: str, where: str) -> Block:
        i = next(i for i, (_, n) in enumerate(self.free) if n >= size)
        addr, n = self.free[i]
        self.free[i:i + 1] = [(addr + size, n - size)] if n > size else []
        block = Block(addr, size, category, module, where)
        self.live[addr] = block
        self.top = max(self.top, addr + size)
        self.allocated_bytes += size
        self.history.append((True, block))
        if self.allocated_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_index = self.allocated_bytes, len(self.history)
        return block

    def release(self, block: Block) -> None:
        del self.live[block.addr]
        self.allocated_bytes -= block.size
        self.history.append((False, block))
        self.free.append((block.addr, block.size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for addr, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == addr:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((addr, n))
        self.free = merged

    def live_at_peak(self) -> list[Block]:
        """The blocks allocated when the total first reached its peak (the history replayed)."""
        live: dict[int, Block] = {}
        for allocated, block in self.history[:self.peak_index]:
            if allocated:
                live[id(block)] = block
            else:
                live.pop(id(block), None)
        return list(live.values())


def snapshot_dict(heap: SnapshotHeap, source: str) -> dict[str, Any]:
    """The snapshot dict of a heap's history; ``source`` starts every frame's filename."""
    trace: list[dict[str, Any]] = []
    frames_of: dict[int, list[dict[str, Any]]] = {}  # one list per block, shared by its actions (as torch's)
    for allocated, block in heap.history:
        frames = frames_of.setdefault(id(block), block.frames(source))
        actions = (ALLOC,) if allocated else (FREE_REQUESTED, FREE_COMPLETED)
        trace += [{"action": a, "addr": block.addr, "size": block.size, "stream": 0, "frames": frames} for a in actions]
    total = -(-(heap.top - BASE_ADDRESS) // SEGMENT_ALIGN_BYTES) * SEGMENT_ALIGN_BYTES or SEGMENT_ALIGN_BYTES
    blocks: list[dict[str, Any]] = []
    at = BASE_ADDRESS
    for block in sorted(heap.live.values(), key=lambda b: b.addr):
        if block.addr > at:
            blocks.append({"size": block.addr - at, "requested_size": 0, "state": "inactive", "frames": []})
        blocks.append({"size": block.size, "requested_size": block.size, "state": "active_allocated",
                       "frames": frames_of.get(id(block)) or block.frames(source)})
        at = block.addr + block.size
    if at < BASE_ADDRESS + total:
        blocks.append({"size": BASE_ADDRESS + total - at, "requested_size": 0, "state": "inactive", "frames": []})
    live = sum(b.size for b in heap.live.values())
    segment = {"device": 0, "address": BASE_ADDRESS, "total_size": total, "allocated_size": live,
               "active_size": live, "requested_size": live, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}
    return {"segments": [segment], "device_traces": [trace]}
