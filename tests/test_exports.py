"""`plan --trace`, `--memory-snapshot`, `--html`: the files load in the tools they are for, and
agree with the report (step time, peak allocated bytes)."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from roofplan import api
from roofplan.cli import main as plan_main
from roofplan.export_snapshot import memory_snapshot
from roofplan.export_trace import MEMORY_COUNTER, trace_events
from roofplan.step_spans import COMPUTE, DATA_PARALLEL, PIPELINE, step_spans

# its module-scoped fixtures are built once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("test_exports")

REPO = Path(__file__).resolve().parent.parent
FSDP3 = dict(micro_batch_size=1, precisions="bf16-mixed", checkpoint="all", gpus=4, zero_stage=3)  # ZeRO-3, recompute
TP = dict(micro_batch_size=1, precisions="bf16-mixed", checkpoint="0", gpus=4, zero_stage=2, tp=2)
PIPE = dict(micro_batch_size=1, precisions="bf16-mixed", checkpoint="none", gpus=4, zero_stage=0, pp=2)
CLI = ["--model", "tiny-llama", "--micro-batch", "1", "--precision", "bf16-mixed", "--checkpoint", "all",
       "--gpus", "4", "--zero-stage", "3"]


def _plan(**kw: Any) -> Any:
    model, training = api.load_model("tiny-llama")
    return api.plan(model, training, None, None, **kw)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return {"fsdp3": _plan(**FSDP3), "tp": _plan(**TP), "pipe": _plan(**PIPE)}


def _check_format(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The Trace Event Format's fields (JSON object form): every event has ``ph``, ``pid``;
    ``X`` complete events ``name``, ``ts``, ``dur`` (microseconds, non-negative), ``tid``;
    ``C`` counters numeric ``args``; ``M`` metadata names every process and thread used."""
    events = data["traceEvents"]
    named_pids = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    named_tids = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in events:
        assert e["ph"] in ("X", "C", "M") and isinstance(e["pid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and isinstance(e["tid"], int) and e["dur"] >= 0 and e["ts"] >= 0, e
            assert (e["pid"], e["tid"]) in named_tids, e
        if e["ph"] == "C":
            assert all(isinstance(v, int | float) for v in e["args"].values()), e
        assert e["pid"] in named_pids
    return events


@pytest.mark.parametrize("case", ["fsdp3", "tp", "pipe"])
def test_trace_spans_the_step_and_names_ops(results: dict[str, Any], case: str) -> None:
    result = results[case]
    spans = step_spans(result)
    events = _check_format(json.loads(json.dumps(trace_events(spans))))
    complete = [e for e in events if e["ph"] == "X"]
    end_us = max(e["ts"] + e["dur"] for e in complete)
    assert math.isclose(end_us, result.best.estimate.step_time_s * 1e6, rel_tol=1e-9)
    ops = [e for e in complete if "flops" in e["args"]]
    assert {"blocks.0.mlp.up_proj", "blocks.1.attn.q_proj"} <= {e["name"] for e in ops}
    assert {e["cat"] for e in ops} >= {"forward", "backward"} | ({"recompute"} if case == "fsdp3" else set())
    for e in ops:
        assert set(e["args"]) >= {"flops", "bytes", "intensity_flops_per_byte", "bound"}
    counters = [e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"] == MEMORY_COUNTER]
    assert max(counters) == result.best.estimate.memory.peak_allocated_bytes
    streams = {s.stream for s in spans.spans}
    assert {"fsdp3": {COMPUTE, DATA_PARALLEL}, "tp": {COMPUTE, DATA_PARALLEL, "tensor-parallel collectives (inside ops)"},
            "pipe": {COMPUTE, DATA_PARALLEL, PIPELINE}}[case] == streams
    assert len(spans.ranks) == (2 if case == "pipe" else 1)


def test_ops_tile_their_tasks(results: dict[str, Any]) -> None:
    """A compute task's ops follow each other inside it and end where it ends (the overlap
    slowdown included)."""
    spans = step_spans(results["fsdp3"]).spans
    tasks = [s for s in spans if s.depth == 0 and s.stream == COMPUTE and s.phase in ("forward", "backward")]
    assert tasks
    for task in tasks:
        inside = [s for s in spans if s.depth == 1 and s.rank == task.rank and task.start_s <= s.start_s < task.end_s]
        assert inside and all(s.end_s <= task.end_s * (1 + 1e-12) for s in inside)
        assert math.isclose(max(s.end_s for s in inside), task.end_s, rel_tol=1e-9)
        assert all(a.end_s <= b.start_s * (1 + 1e-12) for a, b in zip(inside, inside[1:], strict=False))


def test_trace_loads_in_perfetto_trace_processor(tmp_path: Path, results: dict[str, Any]) -> None:
    """Where the ``perfetto`` package can start its trace processor (it downloads a binary)."""
    tp_module = pytest.importorskip("perfetto.trace_processor")
    path = tmp_path / "step.json"
    path.write_text(json.dumps(trace_events(step_spans(results["fsdp3"]))))
    try:
        tp = tp_module.TraceProcessor(trace=str(path))
    except Exception as error:  # offline: no binary
        pytest.skip(f"perfetto trace processor unavailable: {error}")
    rows = list(tp.query("select max(ts + dur) as end_ns, count(*) as n from slice"))
    assert math.isclose(rows[0].end_ns, results["fsdp3"].best.estimate.step_time_s * 1e9, rel_tol=1e-6)


@pytest.mark.parametrize("case", ["fsdp3", "pipe"])
def test_snapshot_renders_with_torch_memory_viz(results: dict[str, Any], case: str) -> None:
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    snap = pickle.loads(pickle.dumps(memory_snapshot(results[case])))
    live = peak = 0
    for e in snap["device_traces"][0]:
        assert e["action"] in ("alloc", "free_requested", "free_completed") and e["frames"], e
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    expected = max(s.peak_allocated_bytes for s in results[case].best.estimate.stages) if case == "pipe" else (
        results[case].best.estimate.memory.peak_allocated_bytes)
    assert peak == expected
    segment = snap["segments"][0]
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    assert "snapshot.pickle" in memory_viz.trace_plot(snap)
    assert "segments: 1" in memory_viz.segsum(snap)
    assert "TOTAL MEM" in memory_viz.trace(snap)
    assert "params:0:start" in memory_viz.memory(snap, format_flamegraph=str)  # held to the step's end
    names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert any(n.startswith("blocks.") and ".attn.q_proj [forward, micro-batch 1]" in n for n in names), sorted(names)[:5]


def test_cli_writes_the_three_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("plotly")
    trace, snap, page = tmp_path / "step.json", tmp_path / "snap.pickle", tmp_path / "report.html"
    code = plan_main([*CLI, "--trace", str(trace), "--memory-snapshot", str(snap), "--html", str(page)])
    out = capsys.readouterr().out
    assert code == 0 and out.count("written: ") == 3
    _check_format(json.loads(trace.read_text()))
    text = page.read_text()
    assert "FITS" in text and "Plotly.newPlot" in text and text.count("Plotly.newPlot") == 3
    assert "<script src=" not in text  # plotly.js inlined: no network needed
    html_out = tmp_path / "snap.html"
    ran = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snap), "-o", str(html_out)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0, ran.stderr
    assert html_out.stat().st_size > 0


def test_snapshot_and_trace_do_not_import_torch(tmp_path: Path) -> None:
    code = ("import sys; from roofplan.cli import main; "
            f"code = main({[*CLI, '--trace', str(tmp_path / 't.json'), '--memory-snapshot', str(tmp_path / 's.pickle')]!r}); "
            "assert code == 0, code; assert 'torch' not in sys.modules, 'torch imported'")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert ran.returncode == 0, ran.stderr


@pytest.mark.parametrize("flag", ["--trace", "--memory-snapshot", "--html"])
def test_bad_destination_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    code = plan_main([*CLI, flag, str(tmp_path / "missing" / "f")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{flag}: directory" in err, err


def test_html_without_plotly_names_the_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    code = plan_main([*CLI, "--html", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "roofplan[html]" in err, err
