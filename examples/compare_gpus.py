"""Plan one model on one H100 vs one H200: which fits, and how fast.

    python examples/compare_gpus.py                      # llama3-8b, its published workload
    python examples/compare_gpus.py --model tiny-llama   # seconds, for a smoke test
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from hardware.units import format_bytes
from roofplan import api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--devices", default="h100-sxm,h200")
    args = parser.parse_args()

    model, training = api.load_model(args.model, seq_len=args.seq_len, global_batch_size=args.global_batch)
    table = Table(title=f"{model.name}: {training.seq_len} tokens x {training.global_batch_size} sequences per step")
    for column in ("device", "fits", "micro-batch x accum", "precision", "checkpointed", "device memory",
                   "step time", "tokens/s", "MFU"):
        table.add_column(column)
    for device in args.devices.split(","):
        try:
            result = api.plan(model, training, device)
        except api.InfeasibleError as error:
            needs = error.closest.best.estimate.memory.device_bytes if error.closest else None
            table.add_row(device, "no", "-", "-", "-", f"needs {format_bytes(needs)}" if needs else "-", "-", "-", "-")
            continue
        k, est = result.best.knobs, result.best.estimate
        table.add_row(device, "yes", f"{k.micro_batch_size} x {k.grad_accum_steps}", k.precision.value,
                      f"{len(k.checkpointed)}/{model.n_layers}",
                      f"{format_bytes(est.memory.device_bytes)} of {format_bytes(result.hbm_cap_bytes)}",
                      f"{est.step_time_s:.2f} s", f"{est.tokens_per_s:,.0f}", f"{est.mfu:.1%}")
    Console().print(table)


if __name__ == "__main__":
    main()
