"""``plan --pp``: a pipeline-parallel plan priced per stage (GPipe and 1F1B), the report's stage
table and ``--json``'s per-stage list, and the requests refused in one line."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_plan as run

from planner.errors import ConfigError
from roofplan import api

FIXED = ("--model", "tiny-llama", "--micro-batch", "1", "--precision", "fp32", "--checkpoint", "none")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_json_lists_every_stage_and_the_memory_is_the_busiest(schedule: str) -> None:
    code, out, _ = run(*FIXED, "--gpus", "4", "--pp", "2", "--pp-schedule", schedule, "--json")
    assert code == 0
    best = json.loads(out)["best"]
    stages = best["estimate"]["stages"]
    assert [s["blocks"] for s in stages] == [[[0, 0]], [[1, 1]]]
    assert best["estimate"]["memory"]["peak_allocated_bytes"] == max(s["peak_allocated_bytes"] for s in stages)
    assert best["knobs"]["parallel"]["pp"] == 2 and best["knobs"]["pp_schedule"] == schedule
    assert best["estimate"]["time"]["pipeline_bubble_s"] > 0


def test_interleaved_ranks_hold_two_stages_and_bubble_less() -> None:
    """Interleaved 1F1B with two stages per rank: rank r runs stages r and r + pp, and the bubble
    shrinks against 1F1B on the same blocks (Narayanan et al. 2021: (p-1)/(vm) against (p-1)/m)."""
    model, training = api.load_model("tiny-llama", global_batch_size=8)
    model = model.model_copy(update={"n_layers": 4})
    runs = {}
    for schedule, virtual in (("1f1b", 1), ("interleaved-1f1b", 2)):
        runs[schedule] = api.plan(model, training, None, gpus=2, pp=2, pp_schedule=schedule, pp_virtual=virtual,
                                  micro_batch_size=1, precisions=["fp32"], checkpoint="none").best.estimate
    stages = runs["interleaved-1f1b"].stages
    assert [s.stages for s in stages] == [(0, 2), (1, 3)] and [s.blocks for s in stages] == [((0, 0), (2, 2)),
                                                                                                ((1, 1), (3, 3))]
    assert runs["interleaved-1f1b"].time.pipeline_bubble_s < runs["1f1b"].time.pipeline_bubble_s


def test_the_report_shows_the_stages() -> None:
    code, out, _ = run(*FIXED, "--gpus", "4", "--pp", "2", "--json")
    assert code == 0
    from rich.console import Console

    from planner.program.results import PlanResult
    from roofplan.render import report

    console = Console(width=200, record=True)
    console.print(report(PlanResult.model_validate_json(out)))
    text = console.export_text()
    assert "Pipeline (2 ranks, 1f1b" in text and "(busiest)" in text and "PP 2" in text


def test_gpipe_holds_more_than_1f1b_on_the_first_stage() -> None:
    """GPipe keeps every micro-batch's activations until its backward, 1F1B at most pp of them."""
    model, training = api.load_model("tiny-llama", global_batch_size=16)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        result = api.plan(model, training, None, gpus=2, pp=2, pp_schedule=schedule, micro_batch_size=1,
                          precisions=["fp32"], checkpoint="none")
        peaks[schedule] = result.best.estimate.stages[0].peak_allocated_bytes  # the first rank's
    assert peaks["gpipe"] > peaks["1f1b"]


@pytest.mark.parametrize(("extra", "message"), [
    (("--gpus", "4", "--pp", "3"), "--pp: 3 must be a positive divisor"),
    (("--gpus", "4", "--pp", "2", "--pp-schedule", "dualpipev", "--pp-virtual", "2"), "4 stages for 2 blocks"),
    (("--gpus", "4", "--pp", "2", "--pp-schedule", "1f1b", "--pp-virtual", "2"), "--pp-virtual 2: --pp-schedule 1f1b runs one stage per rank"),
    (("--gpus", "4", "--pp", "2", "--pp-schedule", "zigzag"), "--pp-schedule: 'zigzag' is not a schedule"),
    (("--gpus", "4", "--pp", "2", "--pp-layers", "1,2"), "pp_layers: 1,2 must give 2 stages"),
    (("--gpus", "4", "--pp", "2", "--pp-layers", "a,b"), "--pp-layers: 'a,b' must be block counts"),
    (("--gpus", "4", "--pp-layers", "1,1"), "--pp-layers: splits the blocks over pipeline stages"),
])
def test_impossible_pipelines_are_one_line(extra: tuple[str, ...], message: str) -> None:
    code, out, err = run(*FIXED, *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(("schedule", "checkpoint", "global_batch", "message"), [
    ("dualpipev", "none", 2, "needs at least as many micro-batches as its 4 stages"),
    ("zbv-zero-bubble", "all", 8, "splits each backward"),
])
def test_split_backward_refusals(schedule: str, checkpoint: str, global_batch: int, message: str) -> None:
    model, training = api.load_model("tiny-llama", global_batch_size=global_batch)
    model = model.model_copy(update={"n_layers": 4})
    with pytest.raises(ConfigError, match=message):
        api.plan(model, training, None, gpus=2, pp=2, pp_schedule=schedule, pp_virtual=2, micro_batch_size=1,
                 precisions=["fp32"], checkpoint=checkpoint)


def test_a_pipeline_degree_alone_searches_the_rest() -> None:
    """``--pp 2`` fixes the pipeline; the micro-batch, precision, checkpointing, schedule and the
    other degrees are searched, and the plan has two stages."""
    code, out, err = run("--model", "tiny-llama", "--gpus", "4", "--pp", "2", "--json")
    assert code == 0, err
    best = json.loads(out)["best"]
    assert best["knobs"]["parallel"]["pp"] == 2 and len(best["estimate"]["stages"]) == 2
    assert best["knobs"]["pp_schedule"] in ("1f1b", "interleaved-1f1b")
