"""Plan one model on N GPUs at every ZeRO stage: per-GPU memory, step time, exposed communication.

    python examples/zero_stages.py                                   # llama3-8b on 8 H100s
    python examples/zero_stages.py --model llama3-70b --gpus 64 --hardware a100-sxm-80gb
    python examples/zero_stages.py --model tiny-llama --gpus 4      # seconds, for a smoke test

Each stage is searched on its own (micro-batch, precision, checkpointing, and the tensor- and
context-parallel degrees unless --tp/--cp fix them: the layout column says what each row runs,
e.g. ZeRO-0 as TP 8 over the whole node); ZeRO-2/3 rows are planned both ways FSDP2 can
accumulate gradients (reduce-scatter after every micro-batch, or only after the last with the
unsharded gradients held in between). Communication is what the collectives add to the step:
the data-parallel ones beyond the compute they overlap, the TP/CP/EP ones on the critical path.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from hardware.units import format_bytes
from planner.plan.parallel_dims import layout_label
from roofplan import api
from roofplan.cli_support import output_console


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: searched)")
    parser.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: searched)")
    args = parser.parse_args()

    model, training = api.load_model(args.model, global_batch_size=args.global_batch)
    table = Table(title=f"{model.name} on {args.gpus} x {args.hardware}: {training.seq_len} tokens x "
                        f"{training.global_batch_size} sequences per step")
    for column in ("ZeRO", "gradient sync", "fits", "layout", "micro-batch x accum", "precision", "checkpointed",
                   "memory per GPU", "step time", "communication (DP exposed + TP/CP/EP)", "tokens/s"):
        table.add_column(column)
    for stage in (0, 1, 2, 3):
        for sync in ("every", "last") if stage >= 2 else ("once per step",):
            try:
                result = api.plan(model, training, args.hardware, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                                  zero_stage=stage, fsdp_grad_sync="every" if stage < 2 else sync, tp=args.tp,
                                  cp=args.cp)
            except api.InfeasibleError as error:
                needs = error.closest.best.estimate.memory.device_bytes if error.closest else None
                layout = layout_label(error.closest.best.knobs.parallel) if error.closest else "-"
                table.add_row(str(stage), sync, "no", f"(smallest: {layout})", "-", "-", "-",
                              f"needs {format_bytes(needs)}" if needs else "-", "-", "-", "-")
                continue
            k, est = result.best.knobs, result.best.estimate
            sync_text = sync if stage < 2 else ("every micro-batch" if sync == "every" else "last micro-batch")
            t = est.time
            comm = t.communication_s + t.tensor_parallel_s + t.context_parallel_s + t.expert_parallel_s
            table.add_row(str(stage), sync_text, "yes", layout_label(k.parallel), f"{k.micro_batch_size} x {k.grad_accum_steps}",
                          k.precision.value, f"{len(k.checkpointed)}/{model.n_layers}",
                          f"{format_bytes(est.memory.device_bytes)} of {format_bytes(result.hbm_cap_bytes)}",
                          f"{est.step_time_s:.2f} s", f"{t.communication_s:.2f} + {comm - t.communication_s:.2f} s",
                          f"{est.tokens_per_s:,.0f}")
    output_console().print(table)


if __name__ == "__main__":
    main()
