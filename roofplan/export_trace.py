"""``plan --trace step.json``: the predicted steady-state step as a Chrome / Perfetto trace.

The file is the Trace Event Format (the JSON object form, ``{"traceEvents": [...]}``) that
``torch.profiler``'s ``export_chrome_trace`` writes, so it opens in https://ui.perfetto.dev and
chrome://tracing like a measured step:

- one process per drawn rank (every GPU alike without pipeline parallelism; one per pipeline
  stage with it), named by ``"M"`` metadata events (``process_name``, ``thread_name`` and their
  sort indices);
- one thread per GPU stream: compute, the data-parallel collectives' stream, the pipeline's
  sends, and the tensor-, context- and expert-parallel collectives an op waits for;
- ``"X"`` complete events (``ts``, ``dur`` in microseconds): each task of the timeline
  (``forward 0``, ``backward 0``, a collective) and, nested in it, each op, named as the
  reference model's module (``blocks.3.mlp.up_proj``) with its phase as the category and its
  FLOPs, bytes, arithmetic intensity and bound in ``args``;
- a ``"C"`` counter per rank: the allocated bytes of the memory walk, on the same clock.

The spans come from ``roofplan.step_spans``; the last one ends at the report's step time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.errors import ConfigError
from planner.program.results import PlanResult
from roofplan.step_spans import COMPUTE, DATA_PARALLEL, INSIDE_OPS, PIPELINE, StepSpans, step_spans

_US = 1e6
STREAM_ORDER = (COMPUTE, DATA_PARALLEL, PIPELINE, *INSIDE_OPS.values())
MEMORY_COUNTER = "allocated bytes"


def trace_events(spans: StepSpans, title: str = "") -> dict[str, Any]:
    """The trace as a JSON-ready dict: metadata, complete events, memory counters."""
    events: list[dict[str, Any]] = []
    streams = sorted({(s.rank, s.stream) for s in spans.spans}, key=lambda k: (k[0], STREAM_ORDER.index(k[1])))
    tids = {key: STREAM_ORDER.index(key[1]) + 1 for key in streams}
    for rank, label in enumerate(spans.ranks):
        events.append(_meta("process_name", rank, 0, {"name": label}))
        events.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
    for (rank, stream), tid in tids.items():
        events.append(_meta("thread_name", rank, tid, {"name": stream}))
        events.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
    for s in spans.spans:
        events.append({"name": s.name, "cat": s.phase, "ph": "X", "ts": s.start_s * _US,
                       "dur": (s.end_s - s.start_s) * _US, "pid": s.rank, "tid": tids[(s.rank, s.stream)],
                       "args": s.args})
    for m in spans.memory:
        events.append({"name": MEMORY_COUNTER, "ph": "C", "ts": m.time_s * _US, "pid": m.rank,
                       "args": {"bytes": m.allocated_bytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": title, "step_time_s": spans.step_time_s,
                          "peak_allocated_bytes": list(spans.peak_allocated_bytes),
                          "source": "roofplan prediction (plan --trace), not a measurement"}}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_trace(result: PlanResult, path: str | Path) -> Path:
    """Write the chosen plan's step as a trace file; a path that cannot be written is one line."""
    target = Path(path)
    title = f"{result.model.name} on {result.parallel.world_size} x {result.hardware.name}"
    data = trace_events(step_spans(result), title)
    try:
        target.write_text(json.dumps(data, separators=(",", ":")))
    except OSError as error:
        raise ConfigError(f"--trace: cannot write {target}: {error.strerror or error}") from None
    return target
