"""`validate --memory-snapshot / --trace / --compare`: the measured step's files load in torch's
tools and peak where the live-storage tracker does, the predicted files sit beside them, and the
comparison's rows add up to the two peaks and point at what was mispriced."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from planner.memory.types import Category, Phase  # noqa: E402
from planner.program import estimate as estimate_module  # noqa: E402
from planner.program.results import PlanResult  # noqa: E402
from roofplan import api, export_snapshot  # noqa: E402
from roofplan.allocations import Moment  # noqa: E402
from roofplan.export_snapshot import predicted_heap  # noqa: E402
from roofplan.memory_compare import compare  # noqa: E402
from roofplan.validate_cli import main as validate_main  # noqa: E402
from validate import memory_record  # noqa: E402
from validate.simulate import simulate_step  # noqa: E402

# one simulated step shared by the module's tests: all of them on one xdist worker
pytestmark = pytest.mark.xdist_group("test_validate_exports")

MiB = 1 << 20


def _tiny_plan(**kw: Any) -> PlanResult:
    model, training = api.load_model("tiny-llama")
    return api.plan(model, training, None, None, micro_batch_size=4, precisions="bf16-mixed", **kw)  # 2 micro-batches


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``validate plan.json --mode simulate --json --compare --memory-snapshot --trace``, in process,
    keeping the recorder the CLI made."""
    folder = tmp_path_factory.mktemp("validate_exports")
    plan = _tiny_plan(checkpoint="none")
    plan.save(folder / "plan.json")
    made: list[memory_record.MemoryRecorder] = []

    class Kept(memory_record.MemoryRecorder):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(memory_record, "MemoryRecorder", Kept)
        code = validate_main([str(folder / "plan.json"), "--mode", "simulate", "--json", "--compare",
                              "--memory-snapshot", str(folder / "measured.pickle"), "--trace", str(folder / "measured.json")])
    assert code == 0, out.getvalue()
    return {"plan": plan, "folder": folder, "report": json.loads(out.getvalue()), "recorder": made[0]}


def _replayed_peak(snapshot: dict[str, Any]) -> int:
    live = peak = 0
    for e in snapshot["device_traces"][0]:
        assert e["action"] in ("alloc", "free_requested", "free_completed") and e["frames"], e
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    return peak


def test_measured_snapshot_loads_in_memory_viz_and_peaks_at_the_tracker(recorded: dict[str, Any]) -> None:
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    report, folder, plan = recorded["report"], recorded["folder"], recorded["plan"]
    snap = pickle.loads((folder / "measured.pickle").read_bytes())
    assert _replayed_peak(snap) == report["measured"]["peak_allocated_bytes"]
    # the recording hooks change nothing: a step tracked without them peaks at the same byte
    plain = simulate_step(plan.model.config, plan.training, plan.best.knobs, flops=False)
    assert plain.peak_allocated_bytes == report["measured"]["peak_allocated_bytes"]
    segment = snap["segments"][0]
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    memory_viz.trace_plot(snap)  # renders (its HTML embeds the pickle whatever it holds: nothing to read back)
    assert "segments: 1" in memory_viz.segsum(snap)
    assert "params:0:start (params before the step)" in memory_viz.memory(snap, format_flamegraph=str)
    frames = {(f["filename"], f["name"]) for e in snap["device_traces"][0] for f in e["frames"]}  # the fp32 grad: autocast
    assert ("measured/grads", "blocks.1.mlp.up_proj: aten._to_copy.default [backward, micro-batch 1]") in frames
    assert any(f == "measured/activations" and n.startswith("blocks.0.attn.q_proj: ") for f, n in frames)
    predicted = pickle.loads((folder / "measured.predicted.pickle").read_bytes())  # beside it
    assert _replayed_peak(predicted) == report["predicted"]["peak_allocated_bytes"]


def test_measured_trace_counts_ops_and_says_so(recorded: dict[str, Any]) -> None:
    report, folder = recorded["report"], recorded["folder"]
    trace = json.loads((folder / "measured.json").read_text())
    assert "aten ops" in trace["otherData"]["clock"] and "no time" in trace["otherData"]["clock"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    counters = [e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C"]
    assert sum(e["dur"] for e in spans) == len(counters)  # spans tile the ops
    assert max(counters) == report["measured"]["peak_allocated_bytes"]
    assert {"blocks.1.mlp.down_proj", "optimizer.step"} <= {e["name"] for e in spans}
    assert {e["cat"] for e in spans} >= {Phase.FORWARD.value, Phase.BACKWARD.value, Phase.OPTIMIZER.value}
    predicted = json.loads((folder / "measured.predicted.json").read_text())
    assert "prediction" in predicted["otherData"]["source"]


def test_compare_rows_add_up_to_both_peaks(recorded: dict[str, Any]) -> None:
    report, plan = recorded["report"], recorded["plan"]
    comparison = report["memory_comparison"]
    rows = comparison["rows"]
    assert comparison["predicted_peak_bytes"] == report["predicted"]["peak_allocated_bytes"]
    assert comparison["measured_peak_bytes"] == report["measured"]["peak_allocated_bytes"]
    assert sum(r["predicted_bytes"] for r in rows) == comparison["predicted_peak_bytes"]
    assert sum(r["measured_bytes"] for r in rows) == comparison["measured_peak_bytes"]
    differences = [r["measured_bytes"] - r["predicted_bytes"] for r in rows]
    assert [abs(d) for d in differences] == sorted((abs(d) for d in differences), reverse=True)
    predicted_by, measured_by = defaultdict(int), defaultdict(int)
    for r in rows:
        predicted_by[Category(r["category"])] += r["predicted_bytes"]
        measured_by[Category(r["category"])] += r["measured_bytes"]
    # the predicted side is the planner's own breakdown at its peak, category by category
    assert {c: n for c, n in plan.best.estimate.memory.at_peak.items() if n} == dict(predicted_by)
    # and the measured side is attributed in the planner's terms: each category within 0.5% of the peak
    # (AdamW's per-parameter `step` scalars, which a GPU keeps on the host, are the largest: 21 x 512 B)
    for category in set(predicted_by) | set(measured_by):
        assert abs(measured_by[category] - predicted_by[category]) <= 0.005 * comparison["predicted_peak_bytes"], category
    assert {"blocks.0", "blocks.1", "lm_head", "embed", "final_norm", "optimizer.step"} >= {r["module"] for r in rows} - {""}
    assert {"blocks.0", "blocks.1", "lm_head", "embed"} <= {r["module"] for r in rows}
    # at the default depth (the block) the two sides agree module by module within 0.5% of the peak
    assert all(abs(m - p) <= 0.005 * comparison["predicted_peak_bytes"]
               for m, p in ((r["measured_bytes"], r["predicted_bytes"]) for r in rows))


def test_mispriced_optimizer_state_tops_the_comparison(recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner told AdamW keeps three moments per parameter, not two."""
    real = estimate_module.optimizer_spec
    monkeypatch.setattr(estimate_module, "optimizer_spec",
                        lambda kind, impl: real(kind, impl).model_copy(update={"state_tensors_per_param": 3}))
    recorder = recorded["recorder"]
    rows = compare(predicted_heap(recorded["plan"]), recorder.heap, recorder.module_names).rows
    params = recorded["plan"].best.estimate.memory.params_bytes
    assert (rows[0].module, rows[0].category) == ("", Category.OPTIMIZER)
    assert -params - 0.01 * params < rows[0].difference_bytes < -params + 0.01 * params
    assert abs(rows[1].difference_bytes) < 0.05 * params


def test_mispriced_module_tops_the_comparison(recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk told blocks.1.mlp.up_proj saves 1 MiB more for its backward in every micro-batch."""
    real = export_snapshot.walk_moments

    def inflated(program: Any, rank: Any = None) -> tuple[tuple[Moment, ...], int]:
        moments, peak = real(program, rank)
        changed = []
        for m in moments:
            if m.op == "blocks.1.mlp.up_proj" and m.phase in (Phase.FORWARD, Phase.BACKWARD):
                extra = MiB if m.phase is Phase.FORWARD else -MiB
                if m.phase is Phase.FORWARD or not any(c.op == m.op and c.micro_batch == m.micro_batch
                                                       and c.phase is Phase.BACKWARD for c in changed):
                    m = Moment(m.phase, m.op, m.micro_batch, m.temporaries_bytes, m.logits_bytes, m.event,
                               (*m.changes, (Category.ACTIVATIONS, extra)))
            changed.append(m)
        return tuple(changed), peak + MiB

    monkeypatch.setattr(export_snapshot, "walk_moments", inflated)
    recorder = recorded["recorder"]
    rows = compare(predicted_heap(recorded["plan"]), recorder.heap, recorder.module_names, depth=3).rows
    assert (rows[0].module, rows[0].category) == ("blocks.1.mlp", Category.ACTIVATIONS)
    assert -MiB - 64 * 1024 < rows[0].difference_bytes < -MiB + 64 * 1024


def test_what_is_not_recorded_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    many = tmp_path / "two.json"
    _tiny_plan(checkpoint="none", gpus=2, zero_stage=0).save(many)
    one = tmp_path / "one.json"
    _tiny_plan(checkpoint="none").save(one)
    cases = [([str(many), "--mode", "simulate", "--compare"], "uses 2 GPUs"),
             ([str(one), "--mode", "run", "--compare"], "without modules or categories"),
             ([str(one), "--compare", "--compare-rows", "0"], "--compare-rows: must be positive"),
             ([str(one), "--trace", str(tmp_path / "missing" / "t.json")], "--trace: directory")]
    for argv, message in cases:
        code = validate_main(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, (argv, err)


def test_a_destination_that_would_overwrite_the_plan_or_another_file_is_refused(tmp_path: Path) -> None:
    """Before anything runs: the plan file, or one export over another (the predicted files beside
    each included), is one line, exit 2, and the plan file is untouched."""
    from roofplan import api
    from roofplan.validate_cli import main as validate_main

    model, training = api.load_model("tiny-llama", global_batch_size=2)
    plan = api.plan(model, training, "h100-sxm", micro_batch_size=2, precisions=["fp32"], checkpoint="none")
    path = plan.save(tmp_path / "p.json")
    before = path.read_bytes()
    assert validate_main([str(path), "--mode", "simulate", "--trace", str(path)]) == 2
    assert validate_main([str(path), "--mode", "simulate", "--trace", str(tmp_path / "x.json"),
                          "--memory-snapshot", str(tmp_path / "x.json")]) == 2
    assert validate_main([str(path), "--mode", "simulate", "--trace", str(tmp_path / "y.json"),
                          "--memory-snapshot", str(tmp_path / "y.predicted.json")]) == 2
    assert path.read_bytes() == before


def test_a_tied_embedding_gradient_is_credited_where_the_planner_credits_it(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2 ties the LM head to the embedding: named_parameters() names the shared weight once, as
    the embedding's, while the walk credits its gradient to the head; --compare must not show that
    as two opposite gradient rows."""
    from roofplan import api
    from roofplan.validate_cli import main as validate_main

    model, training = api.load_model("tiny-gpt2", global_batch_size=4)  # accumulation: gradients live at the peak
    plan = api.plan(model, training, "h100-sxm", micro_batch_size=2, precisions=["fp32"], checkpoint="none")
    path = plan.save(tmp_path / "tied.json")
    capsys.readouterr()
    validate_main([str(path), "--mode", "simulate", "--compare", "--json"])
    rows = json.loads(capsys.readouterr().out)["memory_comparison"]["rows"]
    grads = [r for r in rows if r["category"] == "grads"]
    assert grads and all(r["predicted_bytes"] == r["measured_bytes"] for r in grads), grads
