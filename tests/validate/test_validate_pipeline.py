"""``validate`` of a pipeline-parallel plan: every pipeline rank's step run by torch.distributed.pipelining
(``validate.pipeline_validate``: the harness of ``validate.pipeline`` under fake tensors, with the plan's
schedule, split, micro-batches, precision, checkpointing, optimizer and data-parallel layout), compared
rank by rank with the plan's ``best.estimate.stages``; the CLI path; the plans it refuses in one line.

Model: the bundled tiny-llama (2 blocks: one per stage at pp 2), 4 micro-batches per step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from cli_helpers import call, run_plan  # noqa: E402

from roofplan import api  # noqa: E402
from roofplan.validate_cli import main as validate_main  # noqa: E402
from validate import pipeline_validate  # noqa: E402
from validate.report import Verdict  # noqa: E402

# every knob fixed (a pipeline plan is priced, not searched)
FIXED: dict[str, Any] = {"micro_batch_size": 1, "tp": 1, "cp": 1, "pp": 2}
# what tests/validate/test_pipeline_memory.py holds the planner to against the harness (GPipe, 1F1B)
WITHIN = 0.01


def _plan(gpus: int = 2, zero_stage: int = 0, schedule: str = "1f1b", precision: str = "bf16-mixed",
          checkpoint: str = "none", model: str = "tiny-llama") -> Any:
    config, training = api.load_model(model, global_batch_size=4 * gpus // 2)
    return api.plan(config, training, "cpu", gpus=gpus, zero_stage=zero_stage, pp_schedule=schedule,
                    precisions=[precision], checkpoint=checkpoint, **FIXED)


@pytest.mark.parametrize(("gpus", "zero_stage", "schedule", "precision", "checkpoint"), [
    (2, 0, "1f1b", "bf16-mixed", "none"),  # autocast over fp32 parameters
    (4, 1, "gpipe", "fp32", "0"),  # ZeRO-1 under the pipeline (emulated), the first block checkpointed
    (4, 2, "1f1b", "bf16-mixed", "none"),  # FSDP2 under the pipeline, its mixed-precision policy
], ids=["1f1b-bf16-mixed", "gpipe-fp32-zero1-checkpointed", "1f1b-fsdp2-bf16-mixed"])
def test_every_rank_is_measured_and_agrees(monkeypatch: pytest.MonkeyPatch, gpus: int, zero_stage: int,
                                           schedule: str, precision: str, checkpoint: str) -> None:
    plan = _plan(gpus, zero_stage, schedule, precision, checkpoint)
    runs: dict[int, int] = {}
    measure = pipeline_validate.measure

    def spy(case: Any, rank: int) -> Any:
        assert (case.n_microbatches, case.micro_batch, case.pp) == (4, 1, 2)
        result = measure(case, rank)
        runs[rank] = result.steps[-1].peak_bytes
        return result

    monkeypatch.setattr(pipeline_validate, "measure", spy)
    report = api.validate(plan, mode="simulate")
    assert report.verdict is Verdict.PASS, report.notes
    assert runs.keys() == {0, 1}  # every rank ran
    predicted = {s.rank: s.peak_allocated_bytes for s in plan.best.estimate.stages}
    for rank in report.pipeline_ranks:
        assert rank.measured_peak_bytes == runs[rank.rank]  # from the run, not the plan
        assert rank.predicted_peak_bytes == predicted[rank.rank]
        assert rank.measured_peak_bytes == pytest.approx(rank.predicted_peak_bytes, rel=WITHIN), rank
        assert rank.measured_at  # torch's action at the peak
    busiest = max(report.pipeline_ranks, key=lambda r: r.predicted_peak_bytes)
    assert busiest.busiest and report.predicted.peak_allocated_bytes == plan.best.estimate.memory.peak_allocated_bytes
    assert report.measured.peak_allocated_bytes == max(runs.values())
    assert abs(report.errors["peak_allocated"]) < WITHIN and "model_flops" not in report.errors
    dumped = report.model_dump(mode="json")
    assert [r["rank"] for r in dumped["pipeline_ranks"]] == [0, 1]


def test_the_cli_validates_a_pipeline_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    code, _, err = run_plan("--model", "tiny-llama", "--hardware", "cpu", "--gpus", "2", "--pp", "2", "--tp", "1",
                            "--cp", "1", "--zero-stage", "0", "--micro-batch", "1", "--precision", "fp32",
                            "--checkpoint", "none", "--global-batch", "4", "--out", str(path))
    assert code == 0, err
    monkeypatch.setenv("COLUMNS", "160")
    code, out, err = call(validate_main, [str(path), "--mode", "simulate"], capsys)
    assert code == 0, err
    assert out.startswith("PASS tiny-llama") and "Peak allocated per pipeline rank" in out
    assert "Schedule1F1B, 4 micro-batches" in " ".join(out.split())
    code, out, err = call(validate_main, [str(path), "--mode", "run"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("validate: error: --mode run: a pipeline-parallel plan (pp 2)")
    assert "--mode simulate" in err


@pytest.mark.parametrize(("options", "message"), [
    ({"gpus": 4, "tp": 2}, "tensor parallelism --tp 2 inside a pipeline (--pp 2) is not run"),
    ({"model": "tiny-gpt2"}, "ties its LM head to its embedding"),
], ids=["tp-under-pp", "tied-embeddings"])
def test_what_the_harness_cannot_run_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            options: dict[str, Any], message: str) -> None:
    config, training = api.load_model(options.get("model", "tiny-llama"), global_batch_size=4)
    fixed = {**FIXED, "tp": options.get("tp", 1)}
    plan = api.plan(config, training, "cpu", gpus=options.get("gpus", 2), zero_stage=0, precisions=["fp32"],
                    checkpoint="none", **fixed)
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    code, out, err = call(validate_main, [str(path), "--mode", "simulate"], capsys)
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"implementation": "hf"}, "--implementation: hf is not run under a pipeline"),
    ({"device": "cuda"}, "--device: a pipeline plan is simulated on the CPU"),
])
def test_options_a_pipeline_plan_cannot_take(kwargs: dict[str, str], message: str) -> None:
    from hardware.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        api.validate(_plan(precision="fp32"), **kwargs)


def test_long_pipelines_measure_the_first_middle_last_and_busiest() -> None:
    assert pipeline_validate.measured_ranks(4, 3) == (0, 1, 2, 3)
    assert pipeline_validate.measured_ranks(8, 2) == (0, 2, 4, 7)
    assert pipeline_validate.measured_ranks(16, 15) == (0, 8, 15)


def test_many_micro_batches_are_measured_as_a_shorter_step_priced_again() -> None:
    assert pipeline_validate.measured_micro_batches(16, 2) == 16
    assert pipeline_validate.measured_micro_batches(1024, 4) == 16
    assert pipeline_validate.measured_micro_batches(1024, 16) == 32
    config, training = api.load_model("tiny-llama", global_batch_size=64)
    plan = api.plan(config, training, "cpu", gpus=2, zero_stage=0, precisions=["fp32"], checkpoint="none", **FIXED)
    knobs, short, est = pipeline_validate._shortened(plan, 16)
    assert (knobs.grad_accum_steps, short.global_batch_size) == (16, 16)
    # the receive buffers (one per micro-batch) are what the shorter step holds less of
    assert 0 < est.memory.peak_allocated_bytes < plan.best.estimate.memory.peak_allocated_bytes
    assert json.loads(plan.model_dump_json())["best"]["knobs"]["grad_accum_steps"] == 64


def test_a_rank_off_by_more_than_the_tolerance_fails_the_plan() -> None:
    from validate.report import Figures, RankComparison, judge

    close = RankComparison(rank=0, stages=(0,), blocks=((0, 0),), predicted_peak_bytes=100, measured_peak_bytes=101,
                           error=0.01)
    off = close.model_copy(update={"rank": 1, "stages": (1,), "measured_peak_bytes": 95, "error": -0.05})
    figures = Figures(peak_allocated_bytes=100)
    assert judge(figures, figures, {"peak_allocated": 0.03}, True, (close,))[1] is Verdict.PASS
    _, verdict, reasons = judge(figures, figures, {"peak_allocated": 0.03}, True, (close, off))
    assert verdict is Verdict.FAIL and reasons == ("pipeline rank 1: peak_allocated off by -5.0% (tolerance ±3%)",)
