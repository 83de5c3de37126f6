"""What every ``--plot`` chart shares (``roofplan.plots``, ``roofplan.plot_pipeline``): a figure
without pyplot, its title naming the plan, the legend outside the axes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hardware.units import format_bytes
from planner.errors import ConfigError
from planner.program.results import PlanResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# legends sit outside the axes, right of them, so they never cover data
LEGEND: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1), "borderaxespad": 0, "fontsize": 8}


def figure_axes(width: float, height: float = 4.5) -> tuple[Figure, Axes]:
    """A figure on its own Agg canvas (no pyplot state to leak), and its axes."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot: needs matplotlib; pip install matplotlib (or roofplan[plot])") from None
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure, figure.subplots()


def chart_title(result: PlanResult, what: str) -> str:
    """``model on 8 × h100-sxm, ZeRO-2 (FSDP2) × 8 GPUs: what``; a first line says when it does not fit."""
    from planner.plan.parallel_dims import layout_label

    knobs, memory = result.best.knobs, result.best.estimate.memory
    where = result.hardware.name
    if knobs.parallel.world_size > 1:
        where = f"{knobs.parallel.world_size} × {where}, {layout_label(knobs.parallel)}"
    title = f"{result.model.name} on {where}: {what}"
    if memory.fits:
        return title
    return (f"DOES NOT FIT: the smallest plan needs {format_bytes(memory.device_bytes)} on the device, "
            f"cap {format_bytes(memory.hbm_cap_bytes)}\n{title}")
