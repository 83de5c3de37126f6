"""``plan --plot DIR``: the charts and what they show (the figure objects), the files written, the
nothing-fits case, and the help naming exactly the charts written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from planner.plan.parallel_dims import layout_label

pytest.importorskip("matplotlib")

from matplotlib.artist import Artist  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from planner.errors import InfeasibleError  # noqa: E402
from planner.program.results import PlanResult  # noqa: E402
from roofplan import api  # noqa: E402
from roofplan.cli import build_parser  # noqa: E402
from roofplan.cli import main as plan_main  # noqa: E402
from roofplan.plot_pipeline import PIPELINE_CHART  # noqa: E402
from roofplan.plots import CHARTS, memory_figure, pareto_figure, write_plots  # noqa: E402

# its module-scoped fixtures are built once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("test_plots")

GB = 1e9


@pytest.fixture(scope="module")
def fsdp() -> PlanResult:
    """ZeRO-3 in bf16-mixed: FSDP2 computes in bf16 without autocast, unlike one GPU."""
    model, training = api.load_model("tiny-llama", seq_len=128, global_batch_size=64)
    return api.plan(model, training, gpus=8, zero_stage=3, micro_batch_size=8, precisions=["bf16-mixed"],
                    checkpoint="none")


@pytest.fixture(scope="module")
def closest() -> PlanResult:
    model, training = api.load_model("tiny-llama")
    with pytest.raises(InfeasibleError) as error:
        api.plan(model, training, hbm="1MB")
    assert isinstance(error.value.closest, PlanResult)
    return error.value.closest


def axes_of(figure: Figure) -> Axes:
    (ax,) = figure.axes
    return ax


def legend_texts(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None
    return [text.get_text() for text in legend.get_texts()]


def drawn(ax: Axes) -> list[Artist]:
    """Every data artist on the axes: lines, markers, filled areas."""
    return [*ax.lines, *ax.collections]


def line(ax: Axes, startswith: str) -> Line2D:
    (found,) = [art for art in ax.lines if str(art.get_label()).startswith(startswith)]
    return found


def ys(drawn_line: Line2D) -> list[float]:
    return [float(y) for y in np.asarray(drawn_line.get_ydata())]


@pytest.mark.parametrize("chart", [pareto_figure, memory_figure])
@pytest.mark.parametrize("plan", ["single", "multi", "closest"])
def test_every_artist_has_a_legend_entry(chart, plan: str, request: pytest.FixtureRequest) -> None:  # noqa: ANN001
    ax = axes_of(chart(request.getfixturevalue(plan)))
    texts = legend_texts(ax)
    for artist in drawn(ax):
        label = str(artist.get_label())
        assert not label.startswith("_"), f"{artist} drawn without a legend entry"
        assert label in texts


def test_pareto_legend_names_the_choice_the_others_and_the_cap(single: PlanResult) -> None:
    assert single.alternatives and single.pareto
    texts = " | ".join(legend_texts(axes_of(pareto_figure(single))))
    for needle in ("Pareto front", "next best plans", "chosen plan", "cap 85.5 GB"):
        assert needle in texts


@pytest.mark.parametrize("chart", [pareto_figure, memory_figure])
@pytest.mark.parametrize("plan", ["single", "multi"])
def test_legend_sits_outside_the_axes(chart, plan: str, request: pytest.FixtureRequest) -> None:  # noqa: ANN001
    figure = chart(request.getfixturevalue(plan))
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    ax = axes_of(figure)
    legend = ax.get_legend()
    assert legend is not None
    legend_box = legend.get_window_extent(renderer)
    axes_box = ax.get_window_extent(renderer)
    assert legend_box.x0 >= axes_box.x1, (legend_box, axes_box)


@pytest.mark.parametrize("plan", ["single", "multi", "fsdp", "closest"])
def test_memory_chart_draws_allocated_and_device_bytes_against_the_cap(plan: str,
                                                                       request: pytest.FixtureRequest) -> None:
    result: PlanResult = request.getfixturevalue(plan)
    memory, hw = result.best.estimate.memory, result.hardware
    ax = axes_of(memory_figure(result))
    allocated = line(ax, "allocated (")
    device = line(ax, "device bytes")
    cap = line(ax, "cap")
    assert max(ys(allocated)) == pytest.approx(memory.peak_allocated_bytes / GB, rel=1e-9)
    assert max(ys(device)) == pytest.approx(memory.device_bytes / GB, rel=1e-6)
    assert f"× {hw.fragmentation_factor:g} fragmentation" in str(device.get_label())
    assert "runtime reserve" in str(device.get_label())
    assert set(ys(cap)) == {result.hbm_cap_bytes / GB}
    assert all(y >= a for y, a in zip(ys(device), ys(allocated), strict=True))


def test_multi_gpu_titles_name_gpus_and_sharding(multi: PlanResult) -> None:
    knobs = multi.best.knobs
    assert knobs.data_parallel == 8
    for chart in (pareto_figure, memory_figure):
        title = axes_of(chart(multi)).get_title()
        assert f"8 × {multi.hardware.name}" in title
        assert layout_label(knobs.parallel) in title and f"ZeRO-{knobs.zero_stage}" in title


def test_nothing_fits_titles_say_so(closest: PlanResult, single: PlanResult) -> None:
    assert not closest.best.estimate.memory.fits
    for chart in (pareto_figure, memory_figure):
        assert axes_of(chart(closest)).get_title().startswith("DOES NOT FIT")
        assert "DOES NOT FIT" not in axes_of(chart(single)).get_title()
    assert "smallest plan (does not fit)" in legend_texts(axes_of(pareto_figure(closest)))


def test_write_plots_writes_the_charts(single: PlanResult, tmp_path: Path) -> None:
    paths = write_plots(single, tmp_path / "charts")
    assert [p.name for p in paths] == list(CHARTS)
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_nothing_fits_still_draws_the_smallest_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_dir = tmp_path / "charts"
    code = plan_main(["--model", "tiny-llama", "--hbm", "1MB", "--plot", str(out_dir)])
    _, err = capsys.readouterr()
    assert code == 1
    assert "plan: nothing fits in 1.0 MB" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(CHARTS)


def test_help_names_exactly_the_charts_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (action,) = [a for a in build_parser()._actions if a.dest == "plot"]
    promised = set(re.findall(r"[\w-]+\.png", action.help or ""))
    assert promised == set(CHARTS) | {PIPELINE_CHART}
    code = plan_main(["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32", "--checkpoint", "none",
                      "--plot", str(tmp_path)])
    capsys.readouterr()
    assert code == 0
    assert {p.name for p in tmp_path.iterdir()} == set(CHARTS)  # no pipeline: no pipeline.png
    assert "memory timeline of one step" in " ".join((action.help or "").split())
