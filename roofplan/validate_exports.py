"""``validate --memory-snapshot`` / ``--trace`` / ``--compare``: the measured step's files, the
predicted ones beside them, and the comparison of the two peaks.

- ``--memory-snapshot measured.pickle``: what was measured, in torch's snapshot format
  (``validate.memory_record``: the live-storage tracker's allocations under ``--mode simulate``
  and CPU ``run``; ``torch.cuda.memory._snapshot()`` on a GPU), and beside it
  ``measured.predicted.pickle``, the plan's walk as ``plan --memory-snapshot`` writes it;
- ``--trace measured.json``: ``torch.profiler``'s trace of one more step in ``run`` mode; under
  ``--mode simulate`` the step's module spans on a clock counting aten ops (fake tensors take no
  time; the file says so), and beside it ``measured.predicted.json``, ``plan --trace``'s;
- ``--compare``: ``roofplan.memory_compare`` over the plan's walk and the recorded step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ConfigError
from planner.program.results import PlanResult
from roofplan.memory_compare import DEFAULT_DEPTH, MemoryComparison, compare

if TYPE_CHECKING:
    from validate.memory_record import MemoryRecorder


def predicted_path(path: str | Path) -> Path:
    """Where the prediction goes beside a measured file: ``measured.pickle`` -> ``measured.predicted.pickle``."""
    target = Path(path)
    return target.with_name(f"{target.stem}.predicted{target.suffix}")


def check_recorded_paths(plan_path: str, snapshot: str | None, trace: str | None) -> None:
    """Refuse, before anything runs, a destination that would overwrite the plan file or another file
    this run writes (the predicted ones beside each included), or that cannot be written."""
    import os

    targets: dict[Path, str] = {Path(plan_path).resolve(): "the plan file"}
    for flag, path in (("--memory-snapshot", snapshot), ("--trace", trace)):
        if path is None:
            continue
        for target, what in ((Path(path), flag), (predicted_path(path), f"{flag}'s predicted file")):
            resolved = target.resolve()
            if resolved in targets:
                raise ConfigError(f"{flag}: {target} would overwrite {targets[resolved]}; give another file name")
            targets[resolved] = what
            if target.exists() and not os.access(target, os.W_OK) or not os.access(target.parent, os.W_OK):
                raise ConfigError(f"{flag}: cannot write {target} (no permission); give a writable path")


def write_recorded(plan: PlanResult, recorder: MemoryRecorder, snapshot: str | None, trace: str | None) -> list[str]:
    """Write the measured files asked for and the predicted ones beside them; ``"what: path"`` each."""
    from roofplan.export_snapshot import write_memory_snapshot, write_snapshot_dict
    from roofplan.export_trace import write_trace

    written: list[str] = []
    if (snapshot or trace) and not recorder.recorded:
        return ["nothing measured to write: the step did not run to its end (out of memory)"]
    if snapshot:
        measured = write_snapshot_dict(recorder.snapshot(), snapshot)
        predicted = write_memory_snapshot(plan, predicted_path(snapshot))
        written += [f"measured memory snapshot {measured}", f"predicted memory snapshot {predicted} "
                    f"(python -m torch.cuda._memory_viz trace_plot {measured} -o measured.html, the same for each)"]
    if trace:
        target = Path(trace)
        data: dict[str, Any] = recorder.trace(f"{plan.model.name}: measured step")
        try:
            target.write_text(json.dumps(data, separators=(",", ":")))
        except OSError as error:
            raise ConfigError(f"--trace: cannot write {target}: {error.strerror or error}") from None
        predicted = write_trace(plan, predicted_path(trace))
        written += [f"measured trace {target}", f"predicted trace {predicted} (open both in https://ui.perfetto.dev)"]
    return written


def memory_comparison(plan: PlanResult, recorder: MemoryRecorder, depth: int = DEFAULT_DEPTH) -> MemoryComparison:
    """The predicted and the recorded peak side by side (``roofplan.memory_compare``)."""
    from roofplan.export_snapshot import predicted_heap

    if not recorder.recorded:
        raise ConfigError("--compare: nothing measured to compare: the step did not run to its end (out of memory)")
    if not recorder.attributed:
        raise ConfigError("--compare: on a GPU the snapshot is the caching allocator's, without modules or "
                          "categories; compare with --mode simulate (or --mode run --device cpu)")
    return compare(predicted_heap(plan), recorder.heap, recorder.module_names, depth)
