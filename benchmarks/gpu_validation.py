"""GPU validation suite: plan a set of configurations, run each on one GPU, tabulate.

    python benchmarks/gpu_validation.py                 # on a machine with a GPU: writes docs/gpu_validation.md
    python benchmarks/gpu_validation.py --quick --device cpu --out /tmp/v.md   # smoke test (CI)

For every configuration (GPT-2 medium and a ~1B Llama at several micro-batch, checkpoint and
precision settings, plus the planner's own best under the GPU's memory) it predicts with a
profile calibrated on the plan's own kernels on this GPU, runs warm-up plus timed steps, and
records predicted vs measured peak allocated memory (``torch.cuda.max_memory_allocated``) and
step time (CUDA events, median). Targets (issue 4): memory within 5%, time within 15%. Step time is
also predicted with the bundled profile (``--hardware``, what ``plan`` prints), the figure the
time model is judged by. Before the runs it measures the GEMM and attention curves on the device
beside the profile's (``gpu_kernels.kernel_sections``). The page is written as markdown with the
device, driver-visible name and versions.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import kernel_sections  # noqa: E402

from hardware.dtypes import ComputePrecision  # noqa: E402
from hardware.registry import load_hardware  # noqa: E402
from planner.model.config import ModelConfig  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.precision import precision_spec  # noqa: E402
from planner.program.estimate import cached_graph  # noqa: E402
from roofplan import api  # noqa: E402
from validate.calibrate import calibrate  # noqa: E402
from validate.run import run  # noqa: E402

# a Llama 3.2 1B-shaped model: 16 blocks, d 2048, 32 heads, 8 KV heads, d_ff 8192, tied embeddings
LLAMA_1B = ModelConfig(name="llama-1b", family="llama", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                       d_ff=8192, vocab_size=128256, max_seq_len=8192, tie_embeddings=True, rope_theta=500000.0)


def configurations(quick: bool) -> list[tuple[str, ModelConfig, int, int, Knobs | None]]:
    """(label, model, seq_len, global batch, knobs or None for the planner's best)."""
    if quick:
        model, _ = api.load_model("tiny-llama")
        return [
            ("tiny fp32", model, 128, 8, Knobs(micro_batch_size=4, grad_accum_steps=2, precision="fp32")),
            ("tiny bf16-mixed, all checkpointed", model, 128, 8,
             Knobs(micro_batch_size=8, precision="bf16-mixed", checkpoint_blocks=(0, 1))),
            ("tiny, planner's best", model, 128, 8, None),
        ]
    gpt2_medium, _ = api.load_model("gpt2-medium")
    return [
        ("gpt2-medium bf16-mixed", gpt2_medium, 1024, 16, Knobs(micro_batch_size=4, grad_accum_steps=4)),
        ("gpt2-medium bf16-mixed, all checkpointed", gpt2_medium, 1024, 16,
         Knobs(micro_batch_size=16, checkpoint_blocks=tuple(range(24)))),
        ("gpt2-medium fp32", gpt2_medium, 1024, 16, Knobs(micro_batch_size=4, grad_accum_steps=4, precision="fp32")),
        ("gpt2-medium, planner's best", gpt2_medium, 1024, 16, None),
        ("llama-1b bf16-true", LLAMA_1B, 2048, 8, Knobs(micro_batch_size=2, grad_accum_steps=4, precision="bf16-true")),
        ("llama-1b bf16-mixed, half checkpointed", LLAMA_1B, 2048, 8,
         Knobs(micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=tuple(range(8)))),
        ("llama-1b bf16-mixed, all checkpointed", LLAMA_1B, 2048, 8,
         Knobs(micro_batch_size=8, checkpoint_blocks=tuple(range(16)))),
        ("llama-1b, planner's best", LLAMA_1B, 2048, 8, None),
    ]


def _row(label: str, report, knobs: Knobs, bundled_step_s: float) -> str:  # noqa: ANN001
    def gb(value: float | None) -> str:
        return f"{value / 1e9:.2f} GB" if value else "-"

    def ms(value: float | None) -> str:
        return f"{value * 1e3:.1f} ms" if value else "-"

    def pct(key: str) -> str:
        value = report.errors.get(key)
        return f"{value:+.1%}" if value is not None else "-"

    ckpt = f"{len(knobs.checkpointed)} blocks" if knobs.checkpointed else "none"
    measured_s = report.measured.step_time_s
    bundled = f"{bundled_step_s / measured_s - 1:+.1%}" if measured_s else "-"
    verdict = "OOM" if report.out_of_memory else report.verdict.value
    return (f"| {label} | {knobs.precision.value} | {knobs.micro_batch_size}×{knobs.grad_accum_steps} | {ckpt} | "
            f"{gb(report.predicted.peak_allocated_bytes)} | {gb(report.measured.peak_allocated_bytes)} | "
            f"{pct('peak_allocated')} | {ms(report.predicted.step_time_s)} | {ms(report.measured.step_time_s)} | "
            f"{pct('step_time')} | {ms(bundled_step_s)} | {bundled} | {verdict} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--hardware", default="h200", help="bundled profile of this GPU (datasheet peaks)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny configurations (a smoke test of the script)")
    parser.add_argument("--out", default="docs/gpu_validation.md",
                        help="the file to write (its own: docs/validation.md keeps the published-run comparisons)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_validation: no CUDA device; use --device cpu --quick for a smoke test", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "CPU"
    started = time.perf_counter()
    hardware = args.hardware if args.device == "cuda" else "cpu"
    kernels = kernel_sections(torch.device(args.device), load_hardware(hardware), args.quick, repeats=10)
    rows = []
    for label, model, seq_len, global_batch, knobs in configurations(args.quick):
        _, training = api.load_model(model, seq_len=seq_len, global_batch_size=global_batch)
        if knobs is None:
            plan = api.plan(model, training, hardware)
        else:
            fixed = knobs.model_copy(update={"grad_accum_steps": global_batch // knobs.micro_batch_size})
            plan = api.estimate_plan(model, training, hardware, fixed)
        knobs = plan.best.knobs
        spec = precision_spec(knobs.precision)
        graph = cached_graph(model, knobs.micro_batch_size, seq_len, spec)
        # --quick: fp32 (every non-matmul op's) and the plan's precision on one small generic shape (a smoke
        # test of the script, not a calibration)
        wanted = list(dict.fromkeys((ComputePrecision.FP32, spec.matmul_precision)))
        quick = {"precisions": wanted, "shapes": ((256, 256, 256),)} if args.quick else {}
        profile = calibrate(args.device, workload=graph, **quick)
        report = run(plan, device=args.device, steps=args.steps, profile=profile)
        rows.append(_row(label, report, knobs, plan.best.estimate.step_time_s))
        print(rows[-1], flush=True)
    versions = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if args.device == "cuda" else "")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# GPU validation" if args.device == "cuda" else "# Validation (CPU smoke run)",
        "",
        f"Measured on **{device_name}** ({versions}) on {stamp} by `benchmarks/gpu_validation.py`, "
        f"{args.steps} timed steps after 2 warm-up steps per configuration, "
        f"{time.perf_counter() - started:.0f} s in all. Predictions use a profile calibrated on each plan's own "
        "kernels on this device (`validate.calibrate`). "
        + ("Peak: `torch.cuda.max_memory_allocated`; time: CUDA events, median. Targets: memory within 5%, "
           "time within 15%." if args.device == "cuda" else
           "Peak: the live-storage tracker; time: wall clock, median. CPU tolerances: memory 3%, time 40%."),
        "",
        "| configuration | precision | micro-batch × accum | checkpointed | predicted peak | measured peak | error "
        f"| predicted step (calibrated) | measured step | error | predicted step ({hardware} profile) | error | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"## Kernel curves on this device beside the {hardware} profile's", "",
        *kernels,
    ])
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
