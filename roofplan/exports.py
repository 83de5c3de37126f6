"""The files ``plan`` exports besides the plan file: ``--trace`` (Chrome / Perfetto trace,
``roofplan.export_trace``), ``--memory-snapshot`` (PyTorch allocator snapshot,
``roofplan.export_snapshot``) and ``--html`` (self-contained report, ``roofplan.export_html``).

Each exporter is imported only when its flag is given; destinations are checked before the search
runs, so a typo costs no work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.errors import ConfigError
from planner.program.results import PlanResult

# (argparse dest, flag, what the file is)
EXPORTS = (("trace", "--trace", "Chrome/Perfetto trace"), ("memory_snapshot", "--memory-snapshot", "memory snapshot"),
           ("html", "--html", "HTML report"))


def check_export_paths(args: Any) -> None:
    """Refuse a destination that is a directory or sits in a missing one (one line, exit 2)."""
    for dest, flag, _ in EXPORTS:
        path = getattr(args, dest, None)
        if path is None:
            continue
        target = Path(path)
        if target.is_dir():
            raise ConfigError(f"{flag}: {path} is a directory; give a file name")
        if not target.parent.is_dir():
            raise ConfigError(f"{flag}: directory {target.parent} does not exist")


def write_exports(result: PlanResult, args: Any) -> list[str]:
    """Write every export asked for; return ``"what: path"`` for each file written."""
    written = []
    if getattr(args, "trace", None):
        from roofplan.export_trace import write_trace

        written.append(f"trace {write_trace(result, args.trace)} (open it in https://ui.perfetto.dev)")
    if getattr(args, "memory_snapshot", None):
        from roofplan.export_snapshot import write_memory_snapshot

        path = write_memory_snapshot(result, args.memory_snapshot)
        written.append(f"memory snapshot {path} (python -m torch.cuda._memory_viz trace_plot {path} -o snap.html)")
    if getattr(args, "html", None):
        from roofplan.export_html import write_html

        written.append(f"report {write_html(result, args.html)}")
    return written
