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
walk's bytes are already rounded to 512 B). The format itself is written by
``planner.memory.snapshot_format``, shared with what ``validate --memory-snapshot`` measured
(``validate.memory_record``); ``predicted_heap`` keeps each block's op and category for
``validate --compare`` (``roofplan.memory_compare``).

Category colours are not set: memory_viz's page (``MemoryViz.js``, ``annotate_snapshot``) fails
on a trace whose categories do not include ``unknown`` (it pushes to ``snapshot.categores``).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from planner.errors import ConfigError
from planner.memory.snapshot_format import SnapshotHeap, snapshot_dict
from planner.memory.types import Category, Phase
from planner.program.estimate import step_program
from planner.program.results import PlanResult
from roofplan.allocations import Moment, walk_moments

SOURCE = "roofplan"  # every frame's filename starts with it: roofplan/<category>


def _free_bytes(heap: SnapshotHeap, category: Category, n_bytes: int) -> int:
    """Free ``n_bytes`` of ``category``: its latest block of that size, else its latest blocks
    (a partial free keeps the rest as a new block); returns what it could not free."""
    mine = [b for b in heap.live.values() if b.category is category]
    exact = next((b for b in reversed(mine) if b.size == n_bytes), None)
    if exact is not None:
        heap.release(exact)
        return 0
    for block in reversed(mine):
        if n_bytes <= 0:
            break
        heap.release(block)
        if block.size > n_bytes:
            heap.alloc(block.size - n_bytes, category, block.module, block.where)
        n_bytes -= min(n_bytes, block.size)
    return n_bytes


def _where(moment: Moment) -> str:
    where = f"{moment.op}: {moment.event}" if moment.event else moment.op
    when = moment.phase.value if moment.phase is Phase.OPTIMIZER else f"{moment.phase.value}, micro-batch {moment.micro_batch + 1}"
    return f"{where} [{when}]"


def _apply(heap: SnapshotHeap, moment: Moment) -> None:
    """One moment's changes (frees first, see the module docstring), then its momentary bytes."""
    changes = list(moment.changes)
    for j, (category, n) in enumerate(changes):  # allocated and freed between two observations: never seen
        if n < 0:
            k = next((k for k in range(j) if changes[k] == (category, -n)), None)
            if k is not None:
                changes[k] = changes[j] = (category, 0)
    late = [(c, _free_bytes(heap, c, -n)) for c, n in changes if n < 0]
    where = _where(moment)
    for category, n in changes:
        if n > 0:
            heap.alloc(n, category, moment.op, where)
    for category, n in late:
        if n and _free_bytes(heap, category, n):
            raise ValueError(f"memory snapshot: {moment.op} frees more {category.value} than is allocated")
    momentary = [heap.alloc(n, c, moment.op, where) for c, n in ((Category.TEMPORARIES, moment.temporaries_bytes),
                                                                 (Category.LOGITS, moment.logits_bytes)) if n > 0]
    for block in momentary:
        heap.release(block)


def heap_of(moments: tuple[Moment, ...]) -> SnapshotHeap:
    """A walk's moments (``roofplan.allocations.walk_moments``) as allocations and frees."""
    heap = SnapshotHeap()
    for moment in moments:
        _apply(heap, moment)
    return heap


def snapshot_of(moments: tuple[Moment, ...]) -> dict[str, Any]:
    """The snapshot dict of a walk's moments."""
    return snapshot_dict(heap_of(moments), SOURCE)


def predicted_heap(result: PlanResult) -> SnapshotHeap:
    """The chosen plan's step (its busiest rank) as allocations and frees."""
    program = step_program(result.model.config, result.training, result.hardware, result.best.knobs)
    busiest = max(program.ranks, key=lambda r: program.walk(rank=r).peak.bytes) if len(program.ranks) > 1 else None
    moments, _ = walk_moments(program, busiest)
    return heap_of(moments)


def memory_snapshot(result: PlanResult) -> dict[str, Any]:
    """The chosen plan's step (its busiest rank) as a snapshot dict."""
    return snapshot_dict(predicted_heap(result), SOURCE)


def write_snapshot_dict(snapshot: dict[str, Any], path: str | Path, flag: str = "--memory-snapshot") -> Path:
    """Pickle a snapshot dict as ``torch.cuda.memory._dump_snapshot`` does; an unwritable path is one line."""
    target = Path(path)
    try:
        with target.open("wb") as f:
            pickle.dump(snapshot, f)
    except OSError as error:
        raise ConfigError(f"{flag}: cannot write {target}: {error.strerror or error}") from None
    return target


def write_memory_snapshot(result: PlanResult, path: str | Path, flag: str = "--memory-snapshot") -> Path:
    return write_snapshot_dict(memory_snapshot(result), path, flag)
