"""Compare precision policies side by side: bytes per parameter, peak memory, speed.

    python examples/precision_table.py --model llama2-7b --device h100-sxm
    python examples/precision_table.py --model tiny-gpt2 --device a100-sxm-80gb
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from hardware.units import format_bytes
from planner.precision import PRECISION_SPECS
from roofplan import api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--hbm", default=None)
    args = parser.parse_args()

    model, training = api.load_model(args.model)
    hardware = api.load_hardware(args.device)
    table = Table(title=f"{model.name} on {hardware.name}: the fastest plan per precision policy")
    for column in ("policy", "bytes/param (p+g+opt)", "matmuls", "plan", "peak allocated", "step time", "MFU"):
        table.add_column(column)
    for policy, spec in PRECISION_SPECS.items():
        per_param = f"{spec.param_bytes} + {spec.grad_bytes} + {2 * spec.param_bytes}"
        if not hardware.supports(spec.matmul_precision):
            table.add_row(policy.value, per_param, spec.matmul_precision.value, f"{hardware.name} has no "
                          f"{spec.matmul_precision.value}", "-", "-", "-")
            continue
        try:
            result = api.plan(model, training, hardware, args.hbm, precisions=[policy.value])
        except api.InfeasibleError as error:
            needs = error.closest.best.estimate.memory.device_bytes if error.closest else None
            table.add_row(policy.value, per_param, spec.matmul_precision.value, "does not fit",
                          f"needs {format_bytes(needs)}" if needs else "-", "-", "-")
            continue
        k, est = result.best.knobs, result.best.estimate
        table.add_row(policy.value, per_param, spec.matmul_precision.value,
                      f"mb {k.micro_batch_size} x {k.grad_accum_steps}, {len(k.checkpointed)} ckpt",
                      format_bytes(est.memory.peak_allocated_bytes), f"{est.step_time_s:.3f} s", f"{est.mfu:.1%}")
    Console().print(table)


if __name__ == "__main__":
    main()
