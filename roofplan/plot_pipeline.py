"""``pipeline.png`` (``plan --plot DIR`` on a pipeline plan): the schedule as a timeline per rank.

One row per pipeline rank, the first on top, labelled with its stages' blocks and its idle share.
On the row's upper lane every compute action of the step is a bar from its start to its end:
forward, full backward, or a split backward's input (dI) and weight (dW) halves, each labelled
with its micro-batch (numbered from 0, as torch names the actions: ``1F0``), over ``s<stage>`` where
the rank holds several stages (looped and V-shaped schedules); the lane's idle stretches
(the bubble and the waits for sends) are hatched. The row's thin lower lane has the rank's sends
of activations and gradients to its neighbours (its communication stream). The x axis is the
pipeline's span, from the first forward to the last backward; the title gives it, the bubble as
the report's table counts it (the ranks' idle time over ``pp`` × span) and what the step adds
after the span (the data-parallel sync, the optimizer step: not drawn).

The bars are the estimate's own timeline (``roofplan.step_spans.pipeline_tasks``), so each rank's
bars add up to its ``busy_s`` in the report (more by the overlap slowdown where a send runs
beside an action: a bar is wall time, ``busy_s`` the work alone).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from planner.program.results import PlanResult
from roofplan.plot_base import LEGEND, chart_title, figure_axes
from roofplan.step_spans import COMPUTE, PIPELINE, OpSpan, pipeline_tasks

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from planner.program.pipeline_program import StageEstimate

PIPELINE_CHART = "pipeline.png"
KINDS = {"F": ("forward", "tab:blue"), "B": ("backward (input and weight gradients)", "tab:orange"),
         "I": ("backward, input half (dI: the gradient sent back)", "tab:red"),
         "W": ("backward, weight half (dW)", "tab:green")}
SENDS = "sends of activations / gradients\n(the rank's communication stream)"
IDLE = "idle: the bubble and waits for sends"
# each rank's row: the compute lane above, the sends lane below (centres round to the rank)
COMPUTE_LANE = (-0.1, 0.56)  # centre offset, height
SEND_LANE = (0.3, 0.16)
_FONT = 6.5


def pipeline_figure(result: PlanResult) -> Figure:
    """The chosen plan's pipeline schedule: one row per rank (module docstring)."""
    knobs, estimate = result.best.knobs, result.best.estimate
    tasks, span_s = pipeline_tasks(result)
    pp = knobs.parallel.pp
    scale, unit = (1e3, "ms") if span_s < 1 else (1.0, "s")
    compute = [t for t in tasks if t.stream == COMPUTE]
    width = min(18.0, max(11.0, 8 + 0.1 * len(compute) / pp))  # wider for long schedules
    fig, ax = figure_axes(width, max(3.0, 1.4 + 0.6 * pp))
    looped = any(len(s.stages) > 1 for s in estimate.stages)
    _idle(ax, compute, pp, span_s, scale)
    inches_per_s = ax.get_position().width * width / span_s
    # white seams between adjacent actions, unless the actions are too thin to show through them
    edge = "white" if span_s * pp / max(1, len(compute)) * inches_per_s > 0.06 else "face"
    for kind, (label, colour) in KINDS.items():
        mine = [t for t in compute if t.args["kind"] == kind]
        if mine:
            _bars(ax, mine, COMPUTE_LANE, scale, colour, label, edge=edge)
    sends = [t for t in tasks if t.stream == PIPELINE]
    if sends:
        _bars(ax, sends, SEND_LANE, scale, "0.35", SENDS, edge="0.35")
    _labels(ax, compute, inches_per_s, scale, looped)
    ax.set_xlim(0, span_s * scale)
    ax.set_ylim(pp - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(pp), [_row_label(s, span_s) for s in estimate.stages] if estimate.stages
                  else [f"rank {r}" for r in range(pp)], fontsize=8)
    ax.set_xlabel(f"time in the pipeline's span ({unit}); bar labels: micro-batch"
                  + (" over s<stage> (ranks holding several stages)" if looped else ""))
    ax.set_title(_title(result, span_s), fontsize=9)
    ax.legend(**LEGEND)
    return fig


def _bars(ax: Axes, spans: list[OpSpan], lane: tuple[float, float], scale: float, colour: str, label: str,
          edge: str = "white") -> None:
    _boxes(ax, [(s.rank, s.start_s, s.end_s) for s in spans], lane, scale, label=label, facecolor=colour,
           edgecolor=edge, linewidth=0 if edge == "face" else 0.3)


def _boxes(ax: Axes, boxes: list[tuple[int, float, float]], lane: tuple[float, float], scale: float,
           **style: Any) -> None:
    """``(rank, start, end)`` boxes on ``lane`` of their rank's row, as one collection (one legend
    entry; thousands of bars draw in a blink, unlike as many patches)."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    offset, height = lane
    rank, start, end = (np.asarray(column, dtype=float) for column in zip(*boxes, strict=True))
    low = rank + offset - height / 2
    xs = np.stack([start, start, end, end], axis=1) * scale
    ys = np.stack([low, low + height, low + height, low], axis=1)
    ax.add_collection(PolyCollection(list(np.stack([xs, ys], axis=2)), **style))  # one (4, 2) array per bar


def _idle_stretches(compute: list[OpSpan], rank: int, span_s: float) -> list[tuple[float, float]]:
    """``rank``'s compute lane's gaps in the span (start, end): where no action of it runs."""
    gaps, at = [], 0.0
    for s in sorted((s for s in compute if s.rank == rank), key=lambda s: s.start_s):
        if s.start_s > at + 1e-12 * span_s:
            gaps.append((at, s.start_s))
        at = max(at, s.end_s)
    if span_s > at + 1e-12 * span_s:
        gaps.append((at, span_s))
    return gaps


def _idle(ax: Axes, compute: list[OpSpan], pp: int, span_s: float, scale: float) -> None:
    gaps = [(r, a, b) for r in range(pp) for a, b in _idle_stretches(compute, r, span_s)]
    if not gaps:
        return
    _boxes(ax, gaps, COMPUTE_LANE, scale, label=IDLE, facecolor="0.94", edgecolor="0.7", hatch="////", linewidth=0,
           zorder=0)


def _labels(ax: Axes, compute: list[OpSpan], inches_per_s: float, scale: float, looped: bool) -> None:
    """Each action's micro-batch inside its bar (over its stage where a rank holds several), where
    the bar is wide enough for it."""
    offset, _ = COMPUTE_LANE
    for s in compute:
        text = f"{s.args['micro_batch']}\ns{s.args['stage']}" if looped else str(s.args["micro_batch"])
        if (s.end_s - s.start_s) * inches_per_s < 0.62 * _FONT / 72 * max(map(len, text.split())) + 0.02:
            continue
        ax.text((s.start_s + s.end_s) / 2 * scale, s.rank + offset, text, ha="center", va="center",
                fontsize=_FONT, color="white", clip_on=True)


def _row_label(stage: StageEstimate, span_s: float) -> str:
    """``rank 1`` over its stages' blocks and its idle share (the report's figures)."""
    blocks = ", ".join(f"{a}-{b}" for a, b in stage.blocks)
    held = stage.stages
    where = f"stages {', '.join(map(str, held))}: blocks {blocks}" if len(held) > 1 else f"blocks {blocks}"
    return f"rank {stage.rank}\n{where}\nidle {stage.idle_s / span_s:.0%}"


def bubble_fraction(result: PlanResult, span_s: float) -> float:
    """The ranks' idle time over ``pp`` × span, as the report's pipeline table counts it."""
    stages = result.best.estimate.stages
    return math.fsum(s.idle_s for s in stages) / (len(stages) * span_s) if stages else 0.0


def _title(result: PlanResult, span_s: float) -> str:
    knobs, estimate = result.best.knobs, result.best.estimate
    per_rank = f", {knobs.pp_virtual} stages per rank" if knobs.pp_virtual > 1 else ""
    after = estimate.step_time_s - span_s
    head = chart_title(result, f"pipeline schedule ({knobs.pp_schedule.value}{per_rank}, "
                               f"{knobs.grad_accum_steps} micro-batches)")
    return (f"{head}\nspan {_time(span_s)}, bubble {bubble_fraction(result, span_s):.1%} of it; the step "
            f"({_time(estimate.step_time_s)}) adds {_time(after)} after it: data-parallel sync and optimizer "
            f"step (not drawn)")


def _time(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"
