"""``plan --html report.html``: the report and its pictures in one self-contained file.

One HTML file, no server and no network (it can be attached to a ticket): the report as the
terminal prints it, then three interactive charts whose points say what they are on hover:

- the Pareto front: step time vs device memory of the plans found, the next best, the choice, the cap;
- the memory timeline: allocated bytes of every rank drawn over one step, on the step's clock
  (``roofplan.step_spans``), against the cap;
- the schedule: every rank's streams as a Gantt chart (tasks, ops, collectives).

Library: plotly. Its Python package writes a figure as HTML with the whole plotly.js bundle
inlined (``include_plotlyjs=True``), so the file needs nothing else; hover, zoom and pan come
built in; it has no runtime dependency beyond ``narwhals`` and is kept by a company that
releases it monthly. Vega-Lite through altair also inlines, but only with ``vl-convert`` for
the offline bundle, and bokeh needs its resources inlined by hand. plotly is an optional
dependency: ``pip install roofplan[html]``.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ConfigError
from planner.program.results import PlanResult
from roofplan.step_spans import COMPUTE, StepSpans, step_spans

if TYPE_CHECKING:
    from plotly.graph_objects import Figure

_GB = 1e9
_MAX_BARS = 20_000  # op spans drawn in the schedule; beyond it only tasks and collectives
_PHASE_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2c", "recompute": "#e15759", "optimizer": "#59a14f",
                  "collective": "#af7aa1", "repeat": "#bab0ab"}


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise ConfigError("--html: needs plotly; pip install plotly (or roofplan[html])") from None
    return go


def report_text(result: PlanResult) -> str:
    """The report as ``plan`` prints it, as plain text (120 columns)."""
    import io

    from rich.console import Console

    from roofplan.render import print_report

    console = Console(record=True, width=120, file=io.StringIO(), color_system=None)
    print_report(result, console)
    return console.export_text()


def pareto_figure(result: PlanResult) -> Figure:
    go = _plotly()
    fig = go.Figure()
    points = result.pareto
    if points:
        fig.add_trace(go.Scatter(x=[p.device_bytes / _GB for p in points], y=[p.step_time_s for p in points],
                                 mode="lines+markers", line_shape="hv", name="Pareto front",
                                 text=[_knobs(p.knobs) for p in points], hovertemplate="%{text}<extra></extra>"))
    if result.alternatives:
        fig.add_trace(go.Scatter(x=[a.estimate.memory.device_bytes / _GB for a in result.alternatives],
                                 y=[a.estimate.step_time_s for a in result.alternatives], mode="markers",
                                 name="next best plans", marker={"color": "gray"},
                                 text=[_knobs(a.knobs) for a in result.alternatives],
                                 hovertemplate="%{text}<extra></extra>"))
    best = result.best
    fig.add_trace(go.Scatter(x=[best.estimate.memory.device_bytes / _GB], y=[best.estimate.step_time_s],
                             mode="markers", marker={"size": 14, "color": "red"},
                             name="chosen plan" if best.estimate.fits else "smallest plan (does not fit)",
                             text=[_knobs(best.knobs)], hovertemplate="%{text}<extra></extra>"))
    fig.add_vline(x=result.hbm_cap_bytes / _GB, line_dash="dash", annotation_text="cap")
    fig.update_layout(title="step time vs device memory per GPU", xaxis_title="device memory per GPU (GB)",
                      yaxis_title="step time (s)")
    return fig


def _knobs(knobs: Any) -> str:
    from planner.plan.parallel_dims import layout_label

    return (f"micro-batch {knobs.micro_batch_size} x {knobs.grad_accum_steps}<br>{knobs.precision.value}<br>"
            f"{len(knobs.checkpointed)} blocks checkpointed ({knobs.checkpoint_policy.value})<br>"
            f"{html.escape(layout_label(knobs.parallel))}")


def memory_figure(result: PlanResult, spans: StepSpans) -> Figure:
    go = _plotly()
    fig = go.Figure()
    for rank, label in enumerate(spans.ranks):
        samples = [m for m in spans.memory if m.rank == rank]
        fig.add_trace(go.Scatter(x=[m.time_s for m in samples], y=[m.allocated_bytes / _GB for m in samples],
                                 mode="lines", line_shape="hv", name=f"allocated, {label}",
                                 text=[html.escape(m.label) for m in samples],
                                 hovertemplate="%{y:.3f} GB at %{x:.4f} s<br>%{text}<extra></extra>"))
    fig.add_hline(y=result.best.estimate.memory.hbm_cap_bytes / _GB, line_dash="dash",
                  annotation_text="cap (less headroom)")
    fig.update_layout(title="allocated memory over one step (torch.cuda.memory_allocated)",
                      xaxis_title="time in the step (s)", yaxis_title="allocated per GPU (GB)")
    return fig


def schedule_figure(spans: StepSpans) -> Figure:
    """Every rank's streams as rows, each span a bar from its start to its end."""
    go = _plotly()
    drawn = [s for s in spans.spans if s.depth == 0 or len(spans.spans) <= _MAX_BARS]
    fig = go.Figure()
    for phase, colour in _PHASE_COLOURS.items():
        mine = [s for s in drawn if s.phase == phase]
        if not mine:
            continue
        rows = [f"rank {s.rank} {s.stream}" + (" ops" if s.depth and s.stream == COMPUTE else "") for s in mine]
        text = [html.escape(s.name) + "".join(f"<br>{k}: {v}" for k, v in s.args.items()) for s in mine]
        fig.add_trace(go.Bar(y=rows, x=[s.end_s - s.start_s for s in mine], base=[s.start_s for s in mine],
                             orientation="h", name=phase, marker={"color": colour}, text=text,
                             hovertemplate="%{text}<br>%{base:.6f} s + %{x:.6f} s<extra></extra>",
                             textposition="none"))
    fig.update_layout(title=f"schedule of one step ({spans.step_time_s:.4f} s): streams of each rank",
                      xaxis_title="time in the step (s)", barmode="overlay",
                      yaxis={"autorange": "reversed"}, height=240 + 40 * len({(s.rank, s.stream) for s in drawn}))
    return fig


def html_report(result: PlanResult) -> str:
    """The whole page (plotly.js inlined once, in the first chart)."""
    spans = step_spans(result)
    figures = [pareto_figure(result), memory_figure(result, spans), schedule_figure(spans)]
    charts = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figures)]
    title = html.escape(f"roofplan: {result.model.name} on {result.parallel.world_size} x {result.hardware.name}")
    body = "\n".join(f"<section>{c}</section>" for c in charts)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\n"
            f"<body style=\"font-family: sans-serif\"><h1>{title}</h1>\n"
            f"<pre>{html.escape(report_text(result))}</pre>\n{body}\n</body></html>\n")


def write_html(result: PlanResult, path: str | Path) -> Path:
    target = Path(path)
    page = html_report(result)
    try:
        target.write_text(page, encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"--html: cannot write {target}: {error.strerror or error}") from None
    return target
