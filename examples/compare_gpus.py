"""Plan one model on one GPU of each kind: which fits, and how fast.

    python examples/compare_gpus.py                      # llama2-7b, its published workload
    python examples/compare_gpus.py --model tiny-llama   # seconds, for a smoke test

A 7B model trained in bf16-mixed needs 16 bytes per parameter before activations (fp32 weights,
gradients and AdamW's two moments), about 108 GB: with the defaults it does not fit an 80 GB H100
and fits an H200 (141 GB) and a B200.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from hardware.units import format_bytes
from roofplan import api
from roofplan.cli_support import output_console


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--devices", default="h100-sxm,h200,b200")
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
    output_console().print(table)


if __name__ == "__main__":
    main()
