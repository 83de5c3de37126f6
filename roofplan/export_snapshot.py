"""``plan --memory-snapshot snap.pickle``: the predicted memory walk as a PyTorch allocator snapshot.

The file is the dict ``torch.cuda.memory._snapshot()`` returns, pickled as
``torch.cuda.memory._dump_snapshot`` does, so torch's own viewers draw it:
``python -m torch.cuda._memory_viz trace_plot snap.pickle -o snap.html`` (or the file dropped on
https://pytorch.org/memory_viz), and ``stats`` / ``trace`` / ``memory`` / ``segments`` print it.
Plain dicts and lists: writing it imports no torch.

- ``device_traces[0]``: one steady-state step of the busiest rank as allocator actions, in
  order: ``alloc``, then ``free_requested`` and ``free_completed`` (as torch's caching allocator
  records them), each with ``addr``, ``size``, ``stream`` 0 and ``frames``. A frame names the op,
  the phase, the micro-batch and the category (``activations:0:blocks.3.mlp.up_proj [forward,
  micro-batch 0]``): the walk has no Python stacks, so the frame is where in the model it happened.
- ``segments``: one segment holding what is still allocated at the end of the step
  (``active_allocated`` blocks) and the gaps (``inactive``), its ``total_size`` the highest
  address the step reached.

The allocations are the walk's (``roofplan.allocations``): each change of live bytes of one
category at one op is one block (parameters, optimizer state and data are one block each: the
walk sums them), a free releases the latest block of its category and size (or the latest of
its category, a partial free keeping the rest as a new block), an op's momentary temporaries
are allocated and freed at it. Between two observations frees come before allocations, so the
largest total allocated in the trace is the walk's peak: the report's peak allocated bytes.
Addresses come from a first-fit allocator over one segment (no caching-allocator rounding: the
walk's bytes are already rounded to 512 B).

Category colours are not set: memory_viz's page (``MemoryViz.js``, ``annotate_snapshot``) fails
on a trace whose categories do not include ``unknown`` (it pushes to ``snapshot.categores``).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import ConfigError
from planner.memory.types import Category, Phase
from planner.program.estimate import step_program
from planner.program.results import PlanResult
from roofplan.allocations import Moment, walk_moments

BASE_ADDRESS = 0x7F0000000000
_SEGMENT_ALIGN = 2 << 20  # the caching allocator's large segments are multiples of 2 MiB


@dataclass
class _Block:
    addr: int
    size: int
    category: Category
    frames: list[dict[str, Any]]


@dataclass
class _Heap:
    """First-fit addresses over one segment, and the trace of what was done."""

    free: list[tuple[int, int]] = field(default_factory=lambda: [(BASE_ADDRESS, 1 << 60)])  # (addr, size), by addr
    live: list[_Block] = field(default_factory=list)  # in allocation order
    trace: list[dict[str, Any]] = field(default_factory=list)
    top: int = BASE_ADDRESS
    allocated: int = 0
    peak: int = 0

    def alloc(self, size: int, category: Category, frames: list[dict[str, Any]]) -> _Block:
        i = next(i for i, (_, n) in enumerate(self.free) if n >= size)
        addr, n = self.free[i]
        self.free[i:i + 1] = [(addr + size, n - size)] if n > size else []
        block = _Block(addr, size, category, frames)
        self.live.append(block)
        self.top = max(self.top, addr + size)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        self.trace.append(_action("alloc", block))
        return block

    def release(self, block: _Block) -> None:
        self.live.remove(block)
        self.allocated -= block.size
        self.trace += [_action("free_requested", block), _action("free_completed", block)]
        self.free.append((block.addr, block.size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for addr, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == addr:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((addr, n))
        self.free = merged

    def free_bytes(self, category: Category, n_bytes: int) -> int:
        """Free ``n_bytes`` of ``category``: its latest block of that size, else its latest blocks
        (a partial free keeps the rest as a new block); returns what it could not free."""
        mine = [b for b in self.live if b.category is category]
        exact = next((b for b in reversed(mine) if b.size == n_bytes), None)
        if exact is not None:
            self.release(exact)
            return 0
        for block in reversed(mine):
            if n_bytes <= 0:
                break
            self.release(block)
            if block.size > n_bytes:
                self.alloc(block.size - n_bytes, category, block.frames)
            n_bytes -= min(n_bytes, block.size)
        return n_bytes


def _action(action: str, block: _Block) -> dict[str, Any]:
    return {"action": action, "addr": block.addr, "size": block.size, "stream": 0, "frames": block.frames}


def _frames(moment: Moment, category: Category) -> list[dict[str, Any]]:
    where = f"{moment.op}: {moment.event}" if moment.event else moment.op
    when = moment.phase.value if moment.phase is Phase.OPTIMIZER else f"{moment.phase.value}, micro-batch {moment.micro_batch}"
    return [{"filename": f"roofplan/{category.value}", "line": 0, "name": f"{where} [{when}]"}]


def _apply(heap: _Heap, moment: Moment) -> None:
    """One moment's changes (frees first, see the module docstring), then its momentary bytes."""
    changes = list(moment.changes)
    for j, (category, n) in enumerate(changes):  # allocated and freed between two observations: never seen
        if n < 0:
            k = next((k for k in range(j) if changes[k] == (category, -n)), None)
            if k is not None:
                changes[k] = changes[j] = (category, 0)
    late = [(c, heap.free_bytes(c, -n)) for c, n in changes if n < 0]
    for category, n in changes:
        if n > 0:
            heap.alloc(n, category, _frames(moment, category))
    for category, n in late:
        if n and heap.free_bytes(category, n):
            raise ValueError(f"memory snapshot: {moment.op} frees more {category.value} than is allocated")
    momentary = [heap.alloc(n, c, _frames(moment, c)) for c, n in ((Category.TEMPORARIES, moment.temporaries_bytes),
                                                                    (Category.LOGITS, moment.logits_bytes)) if n > 0]
    for block in momentary:
        heap.release(block)


def snapshot_of(moments: tuple[Moment, ...]) -> dict[str, Any]:
    """The snapshot dict of a walk's moments (``roofplan.allocations.walk_moments``)."""
    heap = _Heap()
    for moment in moments:
        _apply(heap, moment)
    total = -(-(heap.top - BASE_ADDRESS) // _SEGMENT_ALIGN) * _SEGMENT_ALIGN or _SEGMENT_ALIGN
    blocks: list[dict[str, Any]] = []
    at = BASE_ADDRESS
    for block in sorted(heap.live, key=lambda b: b.addr):
        if block.addr > at:
            blocks.append({"size": block.addr - at, "requested_size": 0, "state": "inactive", "frames": []})
        blocks.append({"size": block.size, "requested_size": block.size, "state": "active_allocated",
                       "frames": block.frames})
        at = block.addr + block.size
    if at < BASE_ADDRESS + total:
        blocks.append({"size": BASE_ADDRESS + total - at, "requested_size": 0, "state": "inactive", "frames": []})
    live = sum(b.size for b in heap.live)
    segment = {"device": 0, "address": BASE_ADDRESS, "total_size": total, "allocated_size": live,
               "active_size": live, "requested_size": live, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}
    return {"segments": [segment], "device_traces": [heap.trace]}


def memory_snapshot(result: PlanResult) -> dict[str, Any]:
    """The chosen plan's step (its busiest rank) as a snapshot dict."""
    program = step_program(result.model.config, result.training, result.hardware, result.best.knobs)
    busiest = max(program.ranks, key=lambda r: program.walk(rank=r).peak.bytes) if len(program.ranks) > 1 else None
    moments, _ = walk_moments(program, busiest)
    return snapshot_of(moments)


def write_memory_snapshot(result: PlanResult, path: str | Path) -> Path:
    target = Path(path)
    try:
        with target.open("wb") as f:
            pickle.dump(memory_snapshot(result), f)
    except OSError as error:
        raise ConfigError(f"--memory-snapshot: cannot write {target}: {error.strerror or error}") from None
    return target
