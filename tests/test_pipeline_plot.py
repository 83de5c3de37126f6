"""``plan --plot DIR`` on a pipeline plan: ``pipeline.png``, the schedule as a timeline per rank.
One row per rank; its actions' bars add up to the estimate's ``busy_s`` and span the pipeline's
timeline; the sends on their own lane; the idle stretches fill the rest; none for a plan without
a pipeline."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402

from planner.program.results import PlanResult  # noqa: E402
from planner.timing.timeline import Stream  # noqa: E402
from roofplan import api  # noqa: E402
from roofplan.cli import main as plan_main  # noqa: E402
from roofplan.plot_pipeline import (  # noqa: E402
    COMPUTE_LANE,
    IDLE,
    KINDS,
    PIPELINE_CHART,
    SEND_LANE,
    SENDS,
    bubble_fraction,
    pipeline_figure,
)
from roofplan.plots import CHARTS, write_plots  # noqa: E402
from roofplan.step_spans import COMPUTE, PIPELINE, pipeline_tasks, step_spans  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_pipeline_plot")

FIXED = dict(micro_batch_size=1, precisions=["fp32"], checkpoint="none", zero_stage=0, tp=1, cp=1)


def _plan(hardware: str, n_layers: int, pp: int, schedule: str, virtual: int = 1) -> PlanResult:
    model, training = api.load_model("tiny-llama", global_batch_size=8)
    model = model.model_copy(update={"n_layers": n_layers})
    return api.plan(model, training, hardware, None, gpus=pp, pp=pp, pp_schedule=schedule, pp_virtual=virtual,
                    **FIXED)


@pytest.fixture(scope="module")
def plans() -> dict[str, PlanResult]:
    """1F1B on 4 ranks on the CPU profile (no overlap slowdown: a bar is its action's work), and
    a V-shaped split-backward schedule, 2 stages per rank, on H100s (sends slow compute beside them)."""
    return {"1f1b": _plan("cpu", 4, 4, "1f1b"), "zbv": _plan("h100-sxm", 4, 2, "zbv-zero-bubble", 2)}


@pytest.fixture(scope="module")
def axes(plans: dict[str, PlanResult]) -> dict[str, Axes]:
    return {name: pipeline_figure(result).axes[0] for name, result in plans.items()}


def boxes(ax: Axes, label: str) -> list[tuple[int, float, float, float]]:
    """The boxes of the collection drawn as ``label``: (rank of the row, start, end, centre y)."""
    (found,) = [c for c in ax.collections if c.get_label() == label]
    assert isinstance(found, PolyCollection)
    out = []
    for path in found.get_paths():
        xs, ys = path.vertices[:, 0], path.vertices[:, 1]
        centre = (ys.min() + ys.max()) / 2
        out.append((round(centre), float(xs.min()), float(xs.max()), float(centre)))
    return out


def scale_of(ax: Axes) -> float:
    return 1e3 if "(ms)" in ax.get_xlabel() else 1.0


def action_boxes(ax: Axes) -> list[tuple[int, float, float, float]]:
    labels = {c.get_label() for c in ax.collections}
    return [b for label, _ in KINDS.values() if label in labels for b in boxes(ax, label)]


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_one_row_per_rank(plans: dict[str, PlanResult], axes: dict[str, Axes], name: str) -> None:
    ax, pp = axes[name], plans[name].best.knobs.parallel.pp
    assert list(ax.get_yticks()) == list(range(pp))
    assert [t.get_text().split("\n")[0] for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(pp)]
    assert ax.get_ylim() == (pp - 0.5, -0.5)  # rank 0 on top
    bars = action_boxes(ax)
    assert {r for r, *_ in bars} == set(range(pp))
    assert all(math.isclose(y, r + COMPUTE_LANE[0]) for r, _, _, y in bars)
    assert all(math.isclose(y, r + SEND_LANE[0]) for r, _, _, y in boxes(ax, SENDS))


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_bars_are_the_timeline_actions_and_add_up_to_busy(plans: dict[str, PlanResult], axes: dict[str, Axes],
                                                         name: str) -> None:
    result, ax = plans[name], axes[name]
    estimate, slowdown = result.best.estimate, result.hardware.overlap_compute_slowdown
    scale = scale_of(ax)
    (segment,) = estimate.time.timeline.segments
    computes = [s for s in segment.spans if s.task.stream is Stream.COMPUTE]
    bars = action_boxes(ax)
    assert len(bars) == len(computes)
    assert len(boxes(ax, SENDS)) == sum(s.task.stream is Stream.COMMUNICATION for s in segment.spans) > 0
    for stage in estimate.stages:
        drawn = math.fsum(b - a for r, a, b, _ in bars if r == stage.rank) / scale
        if slowdown == 0:
            assert drawn == pytest.approx(stage.busy_s, rel=1e-9)
        else:  # wall time: stretched while a send runs beside, never more than by the slowdown
            assert stage.busy_s * (1 - 1e-9) <= drawn <= stage.busy_s * (1 + slowdown)
        idle = math.fsum(b - a for r, a, b, _ in boxes(ax, IDLE) if r == stage.rank) / scale
        assert drawn + idle == pytest.approx(segment.span_s, rel=1e-9)  # actions and idle tile the row
    assert slowdown == 0 or name == "zbv"


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_the_chart_spans_the_pipeline_and_titles_its_bubble(plans: dict[str, PlanResult], axes: dict[str, Axes],
                                                            name: str) -> None:
    result, ax = plans[name], axes[name]
    span_s = result.best.estimate.time.timeline.step_time_s
    scale = scale_of(ax)
    assert ax.get_xlim() == pytest.approx((0.0, span_s * scale), rel=1e-12)
    assert max(b for _, _, b, _ in action_boxes(ax)) == pytest.approx(span_s * scale, rel=1e-12)
    stages = result.best.estimate.stages
    fraction = sum(s.idle_s for s in stages) / (len(stages) * span_s)
    assert bubble_fraction(result, span_s) == pytest.approx(fraction)
    assert 0 < fraction < 1
    title = ax.get_title()
    assert f"bubble {fraction:.1%}" in title and f"span {span_s * 1e3:.3g} ms" in title
    assert result.best.knobs.pp_schedule.value in title


def test_kinds_and_labels(axes: dict[str, Axes]) -> None:
    """1F1B: forwards and full backwards, labelled with the micro-batch; the V-shaped zero-bubble
    schedule splits backwards into input and weight halves, labelled with micro-batch and stage."""
    labels = {name: {c.get_label() for c in ax.collections} for name, ax in axes.items()}
    assert {KINDS["F"][0], KINDS["B"][0]} <= labels["1f1b"] and KINDS["I"][0] not in labels["1f1b"]
    assert {KINDS["F"][0], KINDS["I"][0], KINDS["W"][0]} <= labels["zbv"]
    texts = {name: [t.get_text() for t in ax.texts] for name, ax in axes.items()}
    assert texts["1f1b"] and set(texts["1f1b"]) <= {str(mb) for mb in range(8)}
    assert texts["zbv"] and all(t.split("\n")[0].isdigit() and t.split("\n")[1].startswith("s") for t in texts["zbv"])
    for ax in axes.values():
        legend = ax.get_legend()
        assert legend is not None
        assert {c.get_label() for c in ax.collections} <= {t.get_text() for t in legend.get_texts()}


def test_pipeline_tasks_are_the_traces_and_survive_a_plan_without_timeline(plans: dict[str, PlanResult]) -> None:
    """The chart's bars are the ``--trace``'s pipeline tasks; a plan read back from a file (no
    timeline) is placed again to the same spans."""
    result = plans["zbv"]
    tasks, span_s = pipeline_tasks(result)
    traced = [s for s in step_spans(result).spans if s.depth == 0 and s.end_s <= span_s * (1 + 1e-12)
              and (s.stream == PIPELINE or (s.stream == COMPUTE and "stage" in s.args))]
    key = lambda s: (s.rank, s.stream, s.name, s.start_s, s.end_s)  # noqa: E731
    assert sorted(map(key, tasks)) == sorted(map(key, traced))
    estimate = result.best.estimate
    bare = result.model_copy(update={"best": result.best.model_copy(update={"estimate": estimate.model_copy(
        update={"time": estimate.time.model_copy(update={"timeline": None})})})})
    again, again_span = pipeline_tasks(bare)
    assert again_span == pytest.approx(span_s, rel=1e-12)
    assert [(s.rank, s.name) for s in again] == [(s.rank, s.name) for s in tasks]


def test_no_schedule_without_a_pipeline(tmp_path: Path) -> None:
    model, training = api.load_model("tiny-llama", global_batch_size=8)
    flat = api.plan(model, training, "cpu", None, gpus=2, **FIXED)
    assert flat.best.knobs.parallel.pp == 1
    assert [p.name for p in write_plots(flat, tmp_path)] == list(CHARTS)
    assert not (tmp_path / PIPELINE_CHART).exists()


def test_cli_plot_writes_the_schedule_of_a_pipeline_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = plan_main(["--model", "tiny-llama", "--hardware", "cpu", "--gpus", "2", "--pp", "2", "--tp", "1",
                      "--cp", "1", "--zero-stage", "0", "--micro-batch", "1", "--precision", "fp32",
                      "--checkpoint", "none", "--global-batch", "8", "--plot", str(tmp_path)])
    out, _ = capsys.readouterr()
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*CHARTS, PIPELINE_CHART])
    assert (tmp_path / PIPELINE_CHART).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert PIPELINE_CHART in out
