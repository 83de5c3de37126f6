"""``validate PLAN.json``: run a plan in PyTorch and say whether it fits and runs as predicted.

Exit codes: 0 it fits and every error is inside its tolerance, 1 it does not, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hardware.errors import ConfigError, PlannerError
from roofplan.cli_support import OneLineParser, StageProgress, check_flag_sizes, ends_quietly, output_console


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="validate", description="Run a plan file in PyTorch: does it fit, is it as fast as predicted?")
    p.add_argument("plan", help="plan file written by `plan --out`")
    p.add_argument("--mode", choices=("auto", "simulate", "run"), default="auto",
                   help="simulate: fake tensors, any size, bytes and FLOPs; run: real steps (default: run on "
                        "CUDA when there is a GPU, else simulate)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="where --mode run runs (default cuda)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after warm-up (default 5)")
    p.add_argument("--hardware", default=None, help="profile to predict time with (e.g. from `hardware calibrate`)")
    p.add_argument("--implementation", choices=("reference", "hf"), default=None,
                   help="whose model runs the plan: reference (roofplan's) or hf (transformers' own, priced "
                        "for it); default the plan's")
    p.add_argument("--memory-snapshot", default=None, metavar="PATH",
                   help="write the measured step's allocations as a PyTorch memory snapshot (memory_viz), and "
                        "the predicted one beside it (NAME.predicted.pickle); one-GPU plans of the reference model")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="write the measured step as a Chrome/Perfetto trace (torch.profiler's in run mode; module "
                        "spans on a clock of aten ops under simulate), and the predicted one beside it")
    p.add_argument("--compare", action="store_true",
                   help="list where the predicted and measured peaks differ most, by module and category")
    p.add_argument("--compare-rows", type=int, default=10, metavar="N", help="rows --compare shows (default 10)")
    p.add_argument("--compare-depth", type=int, default=2, metavar="N",
                   help="module name parts --compare groups by (default 2: blocks.3; 3: blocks.3.mlp)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _check_arguments(args: argparse.Namespace) -> None:
    """What can be checked without torch, before it is imported (a few seconds on a cold start)."""
    from hardware.errors import ConfigError
    from hardware.registry import load_hardware

    if args.steps <= 0:
        raise ConfigError(f"--steps: must be positive, got {args.steps}")
    check_flag_sizes(args)
    if args.mode == "simulate" and args.device == "cuda":
        raise ConfigError("--device: simulate runs on the CPU under fake tensors; drop --device or use --mode run")
    if args.hardware is not None:
        load_hardware(args.hardware)
    from roofplan.exports import check_export_paths

    check_export_paths(args)  # --memory-snapshot, --trace: before anything runs
    from roofplan.validate_exports import check_recorded_paths

    check_recorded_paths(args.plan, args.memory_snapshot, args.trace)
    for flag, value in (("--compare-rows", args.compare_rows), ("--compare-depth", args.compare_depth)):
        if value <= 0:
            raise ConfigError(f"{flag}: must be positive, got {value}")
    if args.compare and args.mode == "run" and args.device != "cpu":
        raise ConfigError(COMPARE_ON_A_GPU)


COMPARE_ON_A_GPU = ("--compare: on a GPU the snapshot is the caching allocator's, without modules or categories; "
                    "compare with --mode simulate (or --mode run --device cpu)")


def _import_api():  # noqa: ANN202
    """``validate.api`` (imports torch), or a one-line error naming what to install."""
    from hardware.errors import ConfigError

    try:
        from validate import api
    except ImportError as error:
        missing = error.name or "torch"
        raise ConfigError(f"needs {missing}, which is not installed; pip install torch "
                          "(or roofplan[validate])") from None
    return api


@ends_quietly("validate")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from planner.program.results import PlanResult

        _check_arguments(args)
        plan = PlanResult.load(args.plan)
        api = _import_api()
        if args.compare and args.mode == "auto" and args.device != "cpu" and api.auto_runs_on_a_gpu():
            raise ConfigError(COMPARE_ON_A_GPU)  # before the run: a GPU run's snapshot cannot be compared
        recorder = None
        if args.memory_snapshot or args.trace or args.compare:
            from validate.memory_record import MemoryRecorder

            recorder = MemoryRecorder()
        with StageProgress(sys.stderr.isatty(), "validate") as progress:
            report = api.validate(plan, mode=args.mode, device=args.device, steps=args.steps, hardware=args.hardware,
                                  progress=progress, implementation=args.implementation, recorder=recorder)
        written, comparison = [], None
        if recorder is not None:  # the report is kept whatever happens to the files
            from roofplan.validate_exports import memory_comparison, write_recorded

            try:
                written = write_recorded(plan, recorder, args.memory_snapshot, args.trace)
                comparison = memory_comparison(plan, recorder, args.compare_depth) if args.compare else None
            except PlannerError as error:
                written.append(f"not written: {error}")
    except PlannerError as error:
        if error.exit_code == 0:  # a non-zero torchrun rank: rank 0 prints the report
            return 0
        print(f"validate: error: {error}", file=sys.stderr)
        return error.exit_code
    if args.json:
        data = report.model_dump(mode="json")
        if comparison is not None:
            data["memory_comparison"] = comparison.model_dump(mode="json")
        if written:
            data["written"] = written
        print(json.dumps(data, indent=2))
    else:
        from roofplan.validate_render import print_comparison, print_report

        print_report(report, output_console())
        if comparison is not None:
            print_comparison(comparison, args.compare_rows, output_console())
        for line in written:  # a file that could not be written says so in its own words
            print(line if line.startswith(("not written", "nothing measured")) else f"written: {line}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
