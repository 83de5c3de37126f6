"""PNG charts of a plan (``plan --plot DIR``): where a picture says more than a table.

- ``pareto.png``: step time vs device memory of every non-dominated plan, the next best plans,
  the choice and the cap;
- ``memory.png``: the memory timeline of one steady-state step of the chosen plan, op by op: the
  allocated bytes (static part and the rest) and the device bytes the fit is decided on
  (allocated × fragmentation factor + runtime reserve), against the cap;
- ``pipeline.png``, for a pipeline plan only: its schedule as a timeline per rank, every action a
  bar, the sends, the bubble (``roofplan.plot_pipeline``).

When nothing fits, the same charts show the smallest plan, titled as not fitting. The
figures are built without pyplot (``pareto_figure``, ``memory_figure``, ``pipeline_figure``
return them), legends sit outside the axes so they never cover data (``roofplan.plot_base``).
matplotlib is an optional dependency (``pip install roofplan[plot]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hardware.units import format_bytes
from planner.errors import ConfigError
from planner.program.results import PlanResult
from roofplan.plot_base import LEGEND, chart_title, figure_axes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

CHARTS = ("pareto.png", "memory.png")  # every plan's; a pipeline plan's also pipeline.png
_GB = 1e9
_FAR = 4  # a cap this many times the plan's device bytes or more: log scale


def write_plots(result: PlanResult, directory: str | Path) -> list[Path]:
    """Write ``CHARTS`` into ``directory`` (created if needed), and ``pipeline.png`` for a pipeline
    plan; return their paths."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--plot: cannot create {out}: {error.strerror or error}") from None
    figures = dict(zip(CHARTS, (pareto_figure(result), memory_figure(result)), strict=True))
    if result.best.knobs.parallel.pp > 1:
        from roofplan.plot_pipeline import PIPELINE_CHART, pipeline_figure

        figures[PIPELINE_CHART] = pipeline_figure(result)
    return [_save(figure, out / name) for name, figure in figures.items()]


def _save(figure: Figure, path: Path) -> Path:
    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as error:
        raise ConfigError(f"--plot: cannot write {path}: {error.strerror or error}") from None
    return path


def pareto_figure(result: PlanResult) -> Figure:
    """Step time vs device memory: the Pareto front, the next best plans, the choice, the cap."""
    fig, ax = figure_axes(7)
    points = result.pareto
    if points:
        ax.step([p.device_bytes / _GB for p in points], [p.step_time_s for p in points], where="post",
                marker="o", ms=3, label="Pareto front: plans that fit (none both faster and smaller)")
    if result.alternatives:
        ax.scatter([a.estimate.memory.device_bytes / _GB for a in result.alternatives],
                   [a.estimate.step_time_s for a in result.alternatives], s=25, c="tab:gray", zorder=4,
                   label="next best plans (the report's table)")
    best = result.best.estimate
    fits = best.memory.fits
    ax.scatter([best.memory.device_bytes / _GB], [best.step_time_s], s=90, c="tab:red", zorder=5,
               marker="o" if fits else "X", label="chosen plan" if fits else "smallest plan (does not fit)")
    ax.axvline(result.hbm_cap_bytes / _GB, color="black", ls="--", lw=1,
               label=f"cap {format_bytes(result.hbm_cap_bytes)}")
    log = _far_cap(ax, "x", [best.memory.device_bytes, *(p.device_bytes for p in points)], result.hbm_cap_bytes)
    ax.set_xlabel(f"device memory per GPU (GB{log})")
    ax.set_ylabel("step time (s)")
    ax.set_title(chart_title(result, "step time vs memory"), fontsize=9)
    ax.legend(**LEGEND)
    return fig


def _trace(result: PlanResult) -> tuple[list[int], Any]:
    """The chosen plan's live bytes after every op of one steady-state step, and its static part."""
    from hardware.registry import load_hardware
    from planner.memory.step import checkpoint_units, simulate_step
    from planner.program.estimate import check_knobs, rank_graph, static_for

    knobs, model, training = result.best.knobs, result.model.config, result.training
    hw = load_hardware(result.hardware)
    spec = check_knobs(model, training, hw, knobs)  # what the step computes in (FSDP2: no autocast), as estimate
    graph = rank_graph(model, training, knobs, spec, hw)
    static = static_for(graph, hw, training, knobs)
    units = checkpoint_units(model.n_layers, knobs.checkpoint_blocks, knobs.checkpoint_segments,
                             knobs.checkpoint_policy, knobs.save_list, knobs.policy_overrides)
    timeline = simulate_step(graph, static, hw.round_alloc, units, knobs.schedule, record_trace=True)
    return [e.live_bytes for e in timeline.trace], static


def memory_figure(result: PlanResult) -> Figure:
    """The memory timeline of one step: allocated bytes and device bytes, against the cap."""
    live, static = _trace(result)
    hw, knobs, memory = result.hardware, result.best.knobs, result.best.estimate.memory
    fig, ax = figure_axes(9)
    xs = range(len(live))
    allocated = [b / _GB for b in live]
    static_gb = (static.params_bytes + static.optimizer_bytes + static.data_bytes) / _GB
    ax.fill_between(xs, 0, [static_gb] * len(live), color="tab:blue", alpha=0.35,
                    label="allocated: params + optimizer state + data (whole step)")
    ax.fill_between(xs, static_gb, allocated, color="tab:orange", alpha=0.45,
                    label="allocated: grads, activations, logits,\ntemporaries" + (
                        ", gathered params" if knobs.parallel.shards_parameters else ""))
    ax.plot(xs, allocated, color="tab:orange", lw=0.8,
            label=f"allocated (torch.cuda.memory_allocated),\npeak {format_bytes(memory.peak_allocated_bytes)} "
                  f"at {memory.peak_op}")
    device = [(b * hw.fragmentation_factor + hw.runtime_reserve_bytes) / _GB for b in live]
    ax.plot(xs, device, color="tab:purple", lw=1.2,
            label=f"device bytes = allocated × {hw.fragmentation_factor:g} fragmentation\n+ "
                  f"{format_bytes(hw.runtime_reserve_bytes, binary=True)} runtime reserve, peak "
                  f"{format_bytes(memory.device_bytes)}:\nwhat the cap is checked against")
    ax.axhline(result.hbm_cap_bytes / _GB, color="black", lw=1, ls="--",
               label=f"cap {format_bytes(result.hbm_cap_bytes)}" + ("" if memory.fits else ": does not fit"))
    log = _far_cap(ax, "y", [memory.device_bytes], result.hbm_cap_bytes)
    if not log:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(f"op, in order ({_walked(knobs.grad_accum_steps)}, then the optimizer step)")
    ax.set_ylabel(f"memory per GPU (GB{log})")
    ax.set_title(chart_title(result, f"memory timeline of one step ({knobs.precision.value}, micro-batch "
                                     f"{knobs.micro_batch_size}, {len(knobs.checkpointed)} blocks checkpointed)"),
                 fontsize=9)
    ax.legend(**LEGEND)
    return fig


def _far_cap(ax: Axes, axis: str, data_bytes: list[int], cap_bytes: int) -> str:
    """A log scale on ``axis`` when the cap is over ``_FAR`` times the data, so that both show;
    returns what to add to the axis label ("" when the scale stays linear)."""
    if cap_bytes <= _FAR * max(data_bytes):
        return ""
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    return ", log scale"


def _walked(grad_accum_steps: int) -> str:
    """Which micro-batches the timeline shows (the walk stops at the second: later ones repeat it)."""
    if grad_accum_steps == 1:
        return "one micro-batch"
    if grad_accum_steps == 2:
        return "micro-batches 1 and 2"
    return f"micro-batches 1 and 2 of {grad_accum_steps}: the others repeat the second"
