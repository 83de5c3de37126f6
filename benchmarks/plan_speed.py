"""Wall time of `plan` with every knob fixed, and how many estimates per second the planner makes.

    python benchmarks/plan_speed.py            # prints a small table; exits 1 if a target is missed

Targets (issue 2): `plan` for llama3-405b with all knobs fixed finishes in under 1 s wall on a
2-core machine and never imports torch.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

COMMAND = [sys.executable, "-m", "planner.cli", "--model", "llama3-405b", "--micro-batch", "1",
           "--precision", "bf16-mixed", "--checkpoint", "all", "--global-batch", "16", "--json"]
NO_TORCH = ("import sys, runpy; sys.argv = ['plan', *sys.argv[1:]]; "
            "from planner.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)")


def wall_times(repeats: int = 5) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(COMMAND, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return times


def estimates_per_second(seconds: float = 2.0) -> tuple[str, float]:
    from hardware.registry import load_hardware
    from planner.estimate import estimate
    from planner.knobs import Knobs
    from planner.model_io import resolve

    model, training = resolve("llama2-7b", seq_len=4096, global_batch_size=64)
    hw = load_hardware("h200")
    knob_list = [Knobs(micro_batch_size=mb, grad_accum_steps=64 // mb, precision=p, checkpoint_blocks=tuple(range(c)))
                 for mb in (1, 2, 4, 8) for p in ("bf16-mixed", "bf16-true") for c in (0, 8, 16, 32)]
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        estimate(model, training, hw, knob_list[count % len(knob_list)])
        count += 1
    return "llama2-7b on h200, varied knobs", count / (time.perf_counter() - start)


def main() -> int:
    times = wall_times()
    median = statistics.median(times)
    torch_free = subprocess.run([sys.executable, "-c", NO_TORCH, *COMMAND[3:]], capture_output=True, check=False)
    label, rate = estimates_per_second()
    print(f"plan llama3-405b, all knobs fixed: median {median:.3f} s wall over {len(times)} runs "
          f"(min {min(times):.3f}, max {max(times):.3f}); target < 1 s")
    print(f"plan imports torch: {'no' if torch_free.returncode in (0, 1) else 'YES: ' + torch_free.stderr.decode()[-200:]}")
    print(f"estimates per second ({label}): {rate:.1f}")
    return 0 if median < 1.0 and torch_free.returncode in (0, 1) else 1


if __name__ == "__main__":
    sys.exit(main())
