"""Sweep the sequence length: the largest micro-batch that fits and the best step time, as a plot.

    python examples/seq_len_sweep.py --out sweep.png
    python examples/seq_len_sweep.py --model tiny-llama --lengths 64,128,256 --out /tmp/sweep.png
"""

from __future__ import annotations

import argparse

from roofplan import api


def largest_micro_batch(model: api.ModelConfig, training: api.TrainConfig, device: str) -> int:
    """The largest micro-batch (a divisor of the global batch) for which some plan fits."""
    sizes = [d for d in range(1, training.global_batch_size + 1) if training.global_batch_size % d == 0]
    best = 0
    for size in sizes:  # memory grows with the micro-batch: stop at the first that cannot fit
        try:
            api.plan(model, training, device, micro_batch_size=size)
        except api.InfeasibleError:
            break
        best = size
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", default="h200")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--out", default="seq_len_sweep.png")
    args = parser.parse_args()

    lengths, micro, step = [], [], []
    for length in (int(n) for n in args.lengths.split(",")):
        model, training = api.load_model(args.model, seq_len=length, global_batch_size=args.global_batch)
        try:
            best = api.plan(model, training, args.device)
        except api.InfeasibleError:
            print(f"seq {length}: nothing fits on {args.device}")
            continue
        lengths.append(length)
        micro.append(largest_micro_batch(model, training, args.device))
        step.append(best.best.estimate.step_time_s)
        print(f"seq {length}: largest micro-batch {micro[-1]}, best step {step[-1]:.3f} s "
              f"({best.best.knobs.precision.value}, {len(best.best.knobs.checkpointed)} blocks checkpointed)")

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
    fig.suptitle(f"{args.model} on {args.device}, {args.global_batch} sequences per step")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
