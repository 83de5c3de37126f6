"""``validate --compare``: where the predicted and the measured peak part ways, by module and category.

Both sides are allocations with a module and a category each: the planner's walk as
``plan --memory-snapshot`` writes it (``roofplan.export_snapshot.predicted_heap``: each block the
op that allocated it and the walk's category) and the measured step as
``validate.memory_record`` recorded it (each storage the module that allocated it and its
category, in the planner's terms). At each side's own peak, the live bytes are summed per
``(module, category)`` and the rows sorted by the size of their difference (measured - predicted).

Module: the walk's ops are named as the reference model's modules (``blocks.3.mlp.up_proj``),
some as code between them (``blocks.3.attn_residual``, ``rope``, ``loss``): a name becomes the
longest module it lies under (``blocks.3``; the model itself, shown ``(model)``), cut to ``depth``
parts (default 2: ``blocks.3``; 3 gives ``blocks.3.mlp``). Parameters, optimizer state and data
are whole-model rows on both sides: the walk counts each as one block. The optimizer step's
temporaries are ``optimizer.step``.

The walk knows the category and bytes of every free, not which tensor it releases: the predicted
side frees the latest live block of that category and size (``roofplan.export_snapshot``), so
where two modules hold tensors of one size, a free can be counted against the wrong one, a pair
of rows of equal and opposite difference. Within a block that is common (a norm's output and a
residual are the same size), so the default depth is the block; across blocks it is rare.

Invariant: every row counted, the differences sum to measured peak - predicted peak (the rows'
bytes are exactly what is live at each peak).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from planner.memory.snapshot_format import OPTIMIZER_STEP, Block, SnapshotHeap
from planner.memory.types import Category

DEFAULT_DEPTH = 2
WHOLE_MODEL = ""  # shown as "(model)"
_MODEL_STATE = (Category.PARAMS, Category.OPTIMIZER, Category.DATA)


class CompareRow(BaseModel):
    model_config = ConfigDict(frozen=True)
    module: str  # "" is the whole model (or its own code between modules)
    category: Category
    predicted_bytes: int
    measured_bytes: int

    @property
    def difference_bytes(self) -> int:
        return self.measured_bytes - self.predicted_bytes


class MemoryComparison(BaseModel):
    """Predicted vs measured live bytes at each side's peak, per (module, category), largest
    |difference| first; the rows sum to the peaks."""

    model_config = ConfigDict(frozen=True)
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_at: str  # what allocated last before each side's peak
    measured_at: str
    depth: int
    rows: tuple[CompareRow, ...]

    @property
    def difference_bytes(self) -> int:
        return self.measured_peak_bytes - self.predicted_peak_bytes


def module_group(name: str, category: Category, modules: frozenset[str], depth: int = DEFAULT_DEPTH) -> str:
    """The row an allocation of ``name`` (an op or module) and ``category`` counts in (see the module docstring)."""
    if category in _MODEL_STATE:
        return WHOLE_MODEL
    if name == OPTIMIZER_STEP:
        return name
    parts = name.split(".")
    under = next((k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), 0)
    return ".".join(parts[:min(under, depth)])


def _sums(blocks: Iterable[Block], modules: frozenset[str], depth: int) -> dict[tuple[str, Category], int]:
    sums: dict[tuple[str, Category], int] = defaultdict(int)
    for block in blocks:
        sums[(module_group(block.module, block.category, modules, depth), block.category)] += block.size
    return sums


def _at(heap: SnapshotHeap) -> str:
    return heap.history[heap.peak_index - 1][1].where if heap.peak_index else ""


def compare(predicted: SnapshotHeap, measured: SnapshotHeap, modules: frozenset[str],
            depth: int = DEFAULT_DEPTH) -> MemoryComparison:
    """The comparison at each heap's peak; ``modules`` are the measured model's module names."""
    p = _sums(predicted.live_at_peak(), modules, depth)
    m = _sums(measured.live_at_peak(), modules, depth)
    rows = [CompareRow(module=key[0], category=key[1], predicted_bytes=p.get(key, 0), measured_bytes=m.get(key, 0))
            for key in sorted(set(p) | set(m))]
    rows.sort(key=lambda r: -abs(r.difference_bytes))
    return MemoryComparison(predicted_peak_bytes=predicted.peak_bytes, measured_peak_bytes=measured.peak_bytes,
                            predicted_at=_at(predicted), measured_at=_at(measured), depth=depth, rows=tuple(rows))
