"""The report's pipeline table: every stage's blocks, memory and share of the step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from hardware.units import format_bytes

if TYPE_CHECKING:
    from planner.program.results import PlanResult


def stages_table(result: PlanResult) -> list[Table]:
    """One row per pipeline stage (none without pipeline parallelism); the busiest is marked."""
    estimate = result.best.estimate
    stages = estimate.stages
    if not stages:
        return []
    knobs = result.best.knobs
    busiest = max(stages, key=lambda s: s.peak_allocated_bytes)
    span = sum(s.busy_s + s.idle_s for s in stages) / len(stages)
    idle = sum(s.idle_s for s in stages)
    per_rank = f", {knobs.pp_virtual} stages per rank" if knobs.pp_virtual > 1 else ""
    title = (f"Pipeline ({knobs.parallel.pp} ranks{per_rank}, {knobs.pp_schedule.value}, {knobs.grad_accum_steps} "
             f"micro-batches; bubble {idle / (len(stages) * span):.1%} of the span; memory above is rank "
             f"{busiest.rank}'s)")
    table = Table(title=title, title_justify="left")
    for name in ("rank", "stages: blocks", "params", "peak allocated", "device", "peak at", "compute", "idle"):
        table.add_column(name, justify="left" if name in ("stages: blocks", "peak at") else "right")
    for s in stages:
        mark = " (busiest)" if s is busiest else ""
        blocks = ", ".join(f"{stage}: {first}-{last}" for stage, (first, last) in zip(s.stages, s.blocks, strict=True))
        table.add_row(f"{s.rank}{mark}", blocks, format_bytes(s.params_bytes),
                      format_bytes(s.peak_allocated_bytes), format_bytes(s.device_bytes),
                      f"{s.peak_phase.value} / {s.peak_op} (mb {s.peak_micro_batch + 1})",
                      f"{s.busy_s:.3f} s", f"{s.idle_s:.3f} s")
    return [table]
