"""``hardware``: list and show device profiles, and calibrate one by measuring this machine.

A façade-level command (like ``plan``): ``calibrate`` imports ``validate`` (torch) lazily."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hardware.errors import PlannerError
from hardware.registry import DEFAULT_HARDWARE, bundled_names, load_hardware
from hardware.units import format_bytes
from roofplan.cli_support import OneLineParser, ends_quietly, output_console


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hardware", description="Device profiles used by `plan --hardware`.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    listing = commands.add_parser("list", help="one line per bundled profile")
    listing.add_argument("--json", action="store_true")
    show = commands.add_parser("show", help="every field of one profile, with its sources")
    show.add_argument("name", help="bundled name or path to a profile YAML")
    show.add_argument("--json", action="store_true")
    cal = commands.add_parser("calibrate", help="measure this machine and write a profile YAML (needs torch)")
    cal.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cal.add_argument("--out", required=True, help="profile YAML to write; use it with plan --hardware")
    cal.add_argument("--name", default=None, help="profile name (default <device>-calibrated)")
    return parser


def _calibrate(device: str, out: str, name: str | None) -> None:
    from pathlib import Path

    import yaml

    from hardware.errors import ConfigError

    target = Path(out)
    if target.is_dir() or not target.parent.is_dir():
        raise ConfigError(f"--out: cannot write a profile to {out}; give a file path in an existing directory")
    try:
        from validate.calibrate import calibrate
    except ImportError:
        raise ConfigError("calibrate: needs torch; pip install torch (or roofplan[validate])") from None
    from roofplan.cli_support import StageProgress

    with StageProgress(sys.stderr.isatty(), "calibrate") as progress:
        progress(f"timing matmuls per precision, streaming bandwidth and kernel launches on {device}")
        profile = calibrate(device, name=name)
    data = profile.model_dump(mode="json")
    header = (f"# measured by `hardware calibrate --device {device}`; use with: plan --hardware {out}\n")
    target.write_text(header + yaml.safe_dump(data, sort_keys=False))
    peaks = ", ".join(f"{p} {v / 1e12:.2f} TFLOP/s" for p, v in data["peak_flops_per_s"].items())
    print(f"wrote {out}: {peaks}; bandwidth {profile.achievable_bandwidth_bytes_per_s() / 1e9:.1f} GB/s; "
          f"{profile.kernel_launch_s * 1e6:.1f} µs per kernel")


def _list(as_json: bool) -> None:
    profiles = [load_hardware(name) for name in bundled_names()]
    if as_json:
        print(json.dumps([p.model_dump(mode="json") for p in profiles], indent=2))
        return
    from rich.table import Table

    table = Table(title=f"Hardware profiles (default {DEFAULT_HARDWARE}; dense peaks, no sparsity)")
    for column in ("name", "memory", "bandwidth", "bf16 TFLOP/s", "fp8 TFLOP/s", "description"):
        table.add_column(column, justify="left" if column in ("name", "description") else "right",
                         no_wrap=column != "description", overflow="fold" if column == "description" else "ellipsis")
    for p in profiles:
        peaks = {k.value: v for k, v in p.peak_flops_per_s.items()}
        table.add_row(
            p.name,
            format_bytes(p.hbm_bytes),
            f"{p.hbm_bandwidth_bytes_per_s / 1e12:.2f} TB/s",
            f"{peaks['bf16'] / 1e12:.1f}" if "bf16" in peaks else "-",
            f"{peaks['fp8'] / 1e12:.1f}" if "fp8" in peaks else "-",
            p.description,
        )
    output_console().print(table)


def _show(name: str, as_json: bool) -> None:
    profile = load_hardware(name)
    data = profile.model_dump(mode="json")
    if as_json:
        print(json.dumps(data, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{profile.name}: {profile.description}", show_header=False)
    for key, value in data.items():
        if key == "sources":
            continue
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    for source in profile.sources:
        table.add_row("source", f"{source.fields}: {source.url}")
    table.add_row("accelerator intensity", ", ".join(
        f"{p.value} {profile.accelerator_intensity(p):.0f} FLOP/B" for p in profile.precisions))
    output_console().print(table)


@ends_quietly("hardware")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "list":
            _list(args.json)
        elif args.command == "calibrate":
            _calibrate(args.device, args.out, args.name)
        else:
            _show(args.name, args.json)
    except PlannerError as error:
        print(f"hardware: error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
