"""Plan one model on N GPUs at every ZeRO stage: per-GPU memory, step time, exposed communication.

    python examples/zero_stages.py                                   # llama3-8b on 8 H100s
    python examples/zero_stages.py --model llama3-70b --gpus 64 --hardware a100-sxm-80gb
    python examples/zero_stages.py --model tiny-llama --gpus 4      # seconds, for a smoke test

Each stage is searched on its own (micro-batch, precision, checkpointing); ZeRO-2/3 rows are
planned both ways FSDP2 can accumulate gradients (reduce-scatter after every micro-batch, or
only after the last with the unsharded gradients held in between).
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
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--global-batch", type=int, default=None)
    args = parser.parse_args()

    model, training = api.load_model(args.model, global_batch_size=args.global_batch)
    table = Table(title=f"{model.name} on {args.gpus} x {args.hardware}: {training.seq_len} tokens x "
                        f"{training.global_batch_size} sequences per step")
    for column in ("ZeRO", "gradient sync", "fits", "micro-batch x accum", "precision", "checkpointed",
                   "memory per GPU", "step time", "exposed comm", "tokens/s"):
        table.add_column(column)
    for stage in (0, 1, 2, 3):
        for sync in ("every", "last") if stage >= 2 else ("once per step",):
            try:
                result = api.plan(model, training, args.hardware, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                                  zero_stage=stage, fsdp_grad_sync="every" if stage < 2 else sync)
            except api.InfeasibleError as error:
                needs = error.closest.best.estimate.memory.device_bytes if error.closest else None
                table.add_row(str(stage), sync, "no", "-", "-", "-", f"needs {format_bytes(needs)}" if needs else "-",
                              "-", "-", "-")
                continue
            k, est = result.best.knobs, result.best.estimate
            sync_text = sync if stage < 2 else ("every micro-batch" if sync == "every" else "last micro-batch")
            table.add_row(str(stage), sync_text, "yes", f"{k.micro_batch_size} x {k.grad_accum_steps}",
                          k.precision.value, f"{len(k.checkpointed)}/{model.n_layers}",
                          f"{format_bytes(est.memory.device_bytes)} of {format_bytes(result.hbm_cap_bytes)}",
                          f"{est.step_time_s:.2f} s", f"{est.time.communication_s:.2f} s", f"{est.tokens_per_s:,.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
