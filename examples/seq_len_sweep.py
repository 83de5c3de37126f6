"""Sweep the sequence length: the largest micro-batch that fits and the best step time, as a plot.

    python examples/seq_len_sweep.py --out sweep.png         # llama3-8b on a node of 8 H100s
    python examples/seq_len_sweep.py --model tiny-llama --gpus 1 --lengths 64,128,256 --out /tmp/sweep.png

Longer sequences leave room for fewer sequences per micro-batch and cost more per token
(attention grows with the square of the length). Each length is planned at the same global
batch in sequences; a length where nothing fits is reported and left out of the plot, and the
sweep exits 1 without a plot when nothing fits at any length.
"""

from __future__ import annotations

import argparse
import sys

from planner.plan.parallel_dims import layout_label
from roofplan import api


def largest_micro_batch(model: api.ModelConfig, training: api.TrainConfig, device: str, gpus: int) -> int:
    """The largest micro-batch (a divisor of each GPU's share of the global batch) for which some
    plan fits, by bisection over the divisors (memory grows with the micro-batch); 0 if none does."""
    share = max(training.global_batch_size // gpus, 1)
    sizes = [d for d in range(1, share + 1) if share % d == 0]
    low, high = 0, len(sizes)  # sizes[:low] fit, sizes[high:] do not
    while low < high:
        mid = (low + high) // 2
        try:
            api.plan(model, training, device, micro_batch_size=sizes[mid], gpus=gpus)
        except api.InfeasibleError:
            high = mid
        else:
            low = mid + 1
    return sizes[low - 1] if low else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--out", default="seq_len_sweep.png")
    args = parser.parse_args()

    lengths, micro, step = [], [], []
    for length in (int(n) for n in args.lengths.split(",")):
        model, training = api.load_model(args.model, seq_len=length, global_batch_size=args.global_batch)
        try:
            best = api.plan(model, training, args.device, gpus=args.gpus)
        except api.InfeasibleError:
            print(f"seq {length}: nothing fits on {args.gpus} x {args.device}")
            continue
        k = best.best.knobs
        lengths.append(length)
        micro.append(largest_micro_batch(model, training, args.device, args.gpus))
        step.append(best.best.estimate.step_time_s)
        layout = f", {layout_label(k.parallel)}" if k.parallel.world_size > 1 else ""
        print(f"seq {length}: largest micro-batch {micro[-1]}, best step {step[-1]:.3f} s "
              f"({k.precision.value}, micro-batch {k.micro_batch_size}, {len(k.checkpointed)} blocks checkpointed"
              f"{layout})")
    if not lengths:
        print(f"nothing fits at any length on {args.gpus} x {args.device}: no plot written (try more --gpus)")
        return 1

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(lengths, micro, marker="o")
    left.set_xscale("log", base=2)
    left.set_xlabel("sequence length")
    left.set_ylabel("largest micro-batch that fits")
    right.plot(lengths, step, marker="o", color="tab:orange")
    right.set_xscale("log", base=2)
    right.set_xlabel("sequence length")
    right.set_ylabel("best step time (s)")
    gpus = f"{args.gpus} x " if args.gpus > 1 else ""
    fig.suptitle(f"{args.model} on {gpus}{args.device}, {args.global_batch} sequences per step")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}: {len(lengths)} of {len(args.lengths.split(','))} lengths plotted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
