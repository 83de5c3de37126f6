"""Plan published pipeline-parallel training runs with their published settings; report the error.

    python benchmarks/published_pipeline_runs.py              # one line per run, the refusals and the summary
    python benchmarks/published_pipeline_runs.py --markdown   # the table of docs/validation.md
    python benchmarks/published_pipeline_runs.py --json       # per-row results and the summary as JSON

Data: ``tests/fixtures/published/pipeline_runs.csv`` (its header names every source by repository, path and
commit): torchtitan's Llama 3.1 405B runs on 512 H100s (FSDP 8 x TP 8 x PP 8, 1F1B and Interleaved1F1B,
Tables 5 and 6 of benchmarks/llama3_h100_202412_torchtitan.md), the Llama rows with PP of NeMo 24.07's
performance table and the Llama 3 70B / 3.1 405B H100 rows of Megatron-Bridge's performance archive. Nothing
here is fitted and nothing is tuned: the bundled ``h100-sxm`` profile prices every row as it is. The error of a
run is ``predicted / published - 1`` on tokens per second per GPU (positive: roofplan is optimistic).

Settings -> roofplan knobs (``api.plan`` with every knob fixed):
- tp, pp, cp, global batch, micro-batch, seq len as published; sequence parallelism with TP (both frameworks
  run it); the micro-batches per step are global batch / (data-parallel ranks x micro-batch).
- schedule: torch's 1F1B and Interleaved1F1B as themselves (``--pp-virtual`` = stages per rank); Megatron-Core's
  interleaved 1F1B as ``interleaved-1f1b`` with ``--pp-virtual`` = its virtual pipeline size (torch's action
  order; Megatron's own warm-up order is not checked against it). ``pp_layers`` where the run's code fixes the split.
- data parallelism: torchtitan's FSDP2 under a pipeline (``reshard_after_forward=False``) -> ZeRO-2 (roofplan's
  FSDP2 under a pipeline: each stage gathered once per step, one reduce-scatter after its last backward; ZeRO-3
  is priced the same). Megatron's DDP with the distributed optimizer -> ZeRO-1 (fp32 master weights and AdamW
  state sharded, gradients reduce-scattered and parameters all-gathered once per step); where roofplan refuses
  ZeRO-1 there (tensor parallelism with DDP/ZeRO-1 is not modelled), FSDP2 under a pipeline is tried next (the
  same collectives once per step). Each refusal is kept with the planner's own words.
- precision: bf16 -> ``bf16-mixed``. fp8 (torchao Float8 linears, Transformer Engine fp8) -> ``fp8-mixed``
  (fp8 matmuls, bf16-mixed memory) where roofplan prices it (DDP/ZeRO-1), else ``bf16-mixed``, marked: roofplan
  refuses fp8 under FSDP2. Every planned row also gets its ``bf16-mixed`` prediction.
- checkpointing: full -> every block, none -> none.
- hardware: ``h100-sxm`` (80 GB HBM3, 700 W, one 400 Gb/s NIC per GPU, 8 per node) for both: DGX H100 is that
  machine; torchtitan's Grand Teton H100s have 96 GB of HBM2e (2.4 TB/s) at a 500 W power limit, so their runs
  are slower per FLOP than the profile (a pessimistic bias of the runs) while compile, Float8 and async TP make
  them faster than roofplan's eager bf16 (an optimistic bias of the runs). A torchtitan row fits if its device
  memory is at most 96 GiB; a DGX row if it fits the profile's cap.

Known differences, none corrected: roofplan prices its eager reference model (unfused RMSNorm, rotary,
SwiGLU, fp32 log-probs at the loss); Megatron/Transformer Engine fuse those memory-bound ops, and
torch.compile fuses them in torchtitan's runs; async TP and Megatron's TP communication overlap hide tensor-parallel
collectives that roofplan puts on the critical path. Uses only the public API (roofplan.api); never imports torch.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from roofplan import api  # noqa: E402

RUNS_CSV = REPO / "tests" / "fixtures" / "published" / "pipeline_runs.csv"
GIB = 2**30

HARDWARE = {"grand-teton-h100-96gb": "h100-sxm", "dgx-h100": "h100-sxm"}
RUN_MEMORY_BYTES = {"grand-teton-h100-96gb": 96 * GIB}  # the runs' own GPUs where they differ from the profile
SCHEDULE = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b", "megatron-interleaved": "interleaved-1f1b"}
ZERO_STAGES = {"fsdp2": (2,), "distributed-optimizer": (1, 2)}  # first accepted wins
PRECISIONS = {"bf16": ("bf16-mixed",), "fp8-torchao": ("fp8-mixed", "bf16-mixed"), "fp8-te": ("fp8-mixed", "bf16-mixed")}
CHECKPOINT = {"full": "all", "none": "none"}


def stack_of(row: dict[str, str]) -> str:
    """The software stack a row ran under (hardware/stacks): torchtitan, compiled or not, and
    NeMo / Megatron-Bridge as Megatron-Core with Transformer Engine."""
    if row["source"] == "torchtitan":
        return "torchtitan-compile" if "torch.compile" in row["other"] else "torchtitan"
    return "megatron"
SOURCES = {
    "torchtitan": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @820504e2",
    "nemo-24.07": "NVIDIA/NeMo docs/source/performance/performance_summary.md @8e3d65dc",
    "megatron-bridge": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @4ab94dfa",
}


def read_csv(path: Path = RUNS_CSV) -> list[dict[str, str]]:
    """Rows of a CSV whose first lines may be ``#`` comments."""
    with path.open(newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@dataclass
class Result:
    id: str
    source: str
    table: str
    model: str
    gpus: int
    seq_len: int
    global_batch: int
    micro_batch: int
    tp: int
    pp: int
    cp: int
    vp: int
    schedule: str
    checkpointing: str
    data_parallel: str
    precision: str
    other: str
    published_tokens_per_s_per_gpu: float
    published_memory_gib: float | None
    dp: int = 0
    micro_batches: int = 0
    zero_stage: int | None = None  # as priced
    roofplan_precision: str = ""  # as priced
    refusals: list[str] = field(default_factory=list)  # the planner's words for every mapping it refused
    skipped: str = ""  # why the row could not be priced at all
    predicted_tokens_per_s_per_gpu: float | None = None
    error: float | None = None  # predicted / published - 1
    predicted_bf16_tokens_per_s_per_gpu: float | None = None
    error_bf16: float | None = None
    predicted_step_s: float | None = None
    published_step_s: float = 0.0
    bubble_share: float | None = None  # the busiest rank's idle in the span / the step
    lower_bound_s: float | None = None  # pure roofline of the busiest rank, no bubble
    device_gib: float | None = None
    memory_limit_gib: float | None = None
    fits: bool | None = None

    @property
    def priced_as(self) -> str:
        """How the row was priced where that differs from how it ran, or ""."""
        notes = []
        if self.roofplan_precision == "bf16-mixed" and self.precision.startswith("fp8"):
            notes.append("fp8 priced as bf16-mixed")
        if self.data_parallel == "distributed-optimizer" and self.zero_stage == 2:
            notes.append("distributed optimizer priced as FSDP2 under a pipeline")
        return "; ".join(notes)


def _knob_candidates(row: dict[str, str]) -> list[tuple[int, str]]:
    return [(z, p) for z in ZERO_STAGES[row["data_parallel"]] for p in PRECISIONS[row["precision"]]]


def _estimate(row: dict[str, str], zero_stage: int, precision: str) -> api.PlanResult:
    """The estimate of one row with every knob fixed (ConfigError when the planner refuses it)."""
    seq_len, gbs = int(row["seq_len"]), int(row["global_batch"])
    model, training = api.load_model(row["model"], seq_len=seq_len, global_batch_size=gbs, stack=stack_of(row))
    tp, cp, vp = int(row["tp"]), int(row["cp"]), int(row["vp"])
    layers = tuple(int(n) for n in row["pp_layers"].split(";")) if row["pp_layers"] else None
    return api.plan(
        model, training, HARDWARE[row["gpu"]], precisions=[precision], micro_batch_size=int(row["micro_batch"]),
        checkpoint=CHECKPOINT[row["checkpointing"]], gpus=int(row["gpus"]), zero_stage=zero_stage, tp=tp,
        sequence_parallel=tp > 1, cp=cp, ep=1, pp=int(row["pp"]), pp_schedule=SCHEDULE[row["schedule"]],
        pp_virtual=vp if vp > 1 else None, pp_layers=layers,
    )


def plan_row(row: dict[str, str], with_bf16: bool = True) -> Result:
    """Price one published row as it ran (or as near as the planner allows, marked); ``with_bf16`` also
    prices an fp8 row in ``bf16-mixed``."""
    gpus, seq_len, gbs = int(row["gpus"]), int(row["seq_len"]), int(row["global_batch"])
    tp, pp, cp = int(row["tp"]), int(row["pp"]), int(row["cp"])
    mem = row["published_memory_gib"]
    r = Result(
        id=row["id"], source=row["source"], table=row["table"], model=row["model"], gpus=gpus, seq_len=seq_len,
        global_batch=gbs, micro_batch=int(row["micro_batch"]), tp=tp, pp=pp, cp=cp, vp=int(row["vp"]),
        schedule=row["schedule"], checkpointing=row["checkpointing"], data_parallel=row["data_parallel"],
        precision=row["precision"], other=row["other"],
        published_tokens_per_s_per_gpu=float(row["published_tokens_per_s_per_gpu"]),
        published_memory_gib=float(mem) if mem else None,
    )
    r.dp = gpus // (tp * pp * cp)
    r.micro_batches = gbs // (r.dp * r.micro_batch)
    r.published_step_s = gbs * seq_len / (r.published_tokens_per_s_per_gpu * gpus)
    result = None
    for zero_stage, precision in _knob_candidates(row):
        try:
            with warnings.catch_warnings():  # a context beyond the model's own (256k): torchtitan ran it so
                warnings.simplefilter("ignore", api.ConfigWarning)
                result = _estimate(row, zero_stage, precision)
        except api.ConfigError as error:
            text = f"ZeRO-{zero_stage}, {precision}: {error}"
            r.refusals.append(text)
            continue
        r.zero_stage, r.roofplan_precision = zero_stage, precision
        break
    if result is None:
        r.skipped = "; ".join(r.refusals)
        return r
    est = result.best.estimate
    r.predicted_tokens_per_s_per_gpu = est.tokens_per_s / gpus
    r.error = r.predicted_tokens_per_s_per_gpu / r.published_tokens_per_s_per_gpu - 1
    r.predicted_step_s = est.step_time_s
    r.bubble_share = est.time.pipeline_bubble_s / est.step_time_s
    r.lower_bound_s = est.time.lower_bound_s
    r.device_gib = est.memory.device_bytes / GIB
    limit = RUN_MEMORY_BYTES.get(row["gpu"], est.memory.hbm_cap_bytes)
    r.memory_limit_gib = limit / GIB
    r.fits = est.memory.device_bytes <= limit
    if r.roofplan_precision == "bf16-mixed":
        r.predicted_bf16_tokens_per_s_per_gpu, r.error_bf16 = r.predicted_tokens_per_s_per_gpu, r.error
    elif with_bf16:
        bf16 = _estimate(row, r.zero_stage, "bf16-mixed").best.estimate  # type: ignore[arg-type]
        r.predicted_bf16_tokens_per_s_per_gpu = bf16.tokens_per_s / gpus
        r.error_bf16 = r.predicted_bf16_tokens_per_s_per_gpu / r.published_tokens_per_s_per_gpu - 1
    return r


def summarize(results: list[Result]) -> dict[str, dict[str, float | int | str]]:
    """Per source and over all priced rows: count, median and worst error (largest |error|)."""
    out: dict[str, dict[str, float | int | str]] = {}
    groups: dict[str, list[Result]] = {"all": [r for r in results if r.error is not None]}
    for r in groups["all"]:
        groups.setdefault(r.source, []).append(r)
    for name, rs in groups.items():
        if not rs:
            continue
        errors = [r.error for r in rs if r.error is not None]
        worst = max(rs, key=lambda r: abs(r.error or 0.0))
        out[name] = {"count": len(rs), "median_error": statistics.median(errors),
                     "median_abs_error": statistics.median(abs(e) for e in errors),
                     "worst_error": worst.error or 0.0, "worst_id": worst.id,
                     "refused": sum(1 for r in results if r.skipped and (name == "all" or r.source == name))}
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _layout(r: Result) -> str:
    parts = [f"DP {r.dp}", f"TP {r.tp}", f"PP {r.pp}"] + ([f"CP {r.cp}"] if r.cp > 1 else []) + (
        [f"VP {r.vp}"] if r.vp > 1 else [])
    return " x ".join(parts)


def print_rows(results: list[Result]) -> None:
    print(f"{'id':<22} {'layout':<30} {'sched':<8} {'mb x n':>7} {'published':>9} {'predicted':>9} {'error':>7} "
          f"{'bf16':>7} {'bubble':>6} {'GiB':>6}  priced as")
    for r in results:
        if r.error is None:
            continue
        print(f"{r.id:<22} {_layout(r):<30} {SCHEDULE[r.schedule]:<8.8} {f'{r.micro_batch} x {r.micro_batches}':>7} "
              f"{r.published_tokens_per_s_per_gpu:>9,.0f} {r.predicted_tokens_per_s_per_gpu:>9,.1f} {_pct(r.error):>7} "
              f"{_pct(r.error_bf16):>7} {100 * (r.bubble_share or 0):>5.1f}% {r.device_gib:>6.1f}  "
              f"ZeRO-{r.zero_stage} {r.roofplan_precision}{' (' + r.priced_as + ')' if r.priced_as else ''}"
              f"{'' if r.fits else f'; NOT FIT in {r.memory_limit_gib:.1f} GiB'}")
    print()


def markdown(results: list[Result]) -> str:
    """The table of docs/validation.md, one line per row."""
    lines = ["| run | settings | published tok/s/GPU | predicted | error | notes |", "|---|---|---:|---:|---:|---|"]
    for r in results:
        settings = (f"{r.gpus} GPUs, {_layout(r)}, {r.schedule}, seq {r.seq_len}, GBS {r.global_batch}, "
                    f"mb {r.micro_batch} x {r.micro_batches}, AC {r.checkpointing}, {r.precision}")
        run = f"{r.model} `{r.id}` ({r.table})"
        if r.error is None:
            lines.append(f"| {run} | {settings} | {r.published_tokens_per_s_per_gpu:,.0f} | not priced | - | "
                         f"{_refusal_summary(r)} |")
            continue
        notes = [f"priced ZeRO-{r.zero_stage} {r.roofplan_precision}"]
        if r.priced_as:
            notes.append(r.priced_as)
        if r.roofplan_precision != "bf16-mixed":
            notes.append(f"bf16-mixed {r.predicted_bf16_tokens_per_s_per_gpu:,.0f} ({_pct(r.error_bf16)})")
        notes.append(f"bubble {100 * (r.bubble_share or 0):.0f}% of the step")
        mem = f"{r.device_gib:.1f} GiB device"
        if r.published_memory_gib is not None:
            mem += f" vs {r.published_memory_gib} published"
        notes.append(mem + ("" if r.fits else f", does NOT fit {r.memory_limit_gib:.0f} GiB"))
        lines.append(f"| {run} | {settings} | {r.published_tokens_per_s_per_gpu:,.0f} | "
                     f"{r.predicted_tokens_per_s_per_gpu:,.1f} | {_pct(r.error)} | {'; '.join(notes)} |")
    return "\n".join(lines)


def _refusal_summary(r: Result) -> str:
    """The planner's reasons, shortened to their first clause, without repeats."""
    seen: dict[str, str] = {}
    for text in r.refusals:
        head, _, reason = text.partition(": ")
        reason = re.sub(r"^(--[\w-]+( / --[\w-]+)*: )", "", reason)  # the flags the message is about
        short = re.split(r" \(|; use|: use|, which", reason)[0]
        seen.setdefault(short, head)
    return "refused: " + " / ".join(f"{head}: {short}" for short, head in seen.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--markdown", action="store_true", help="print the rows as docs/validation.md's table")
    parser.add_argument("--json", action="store_true", help="print per-row results and the summary as JSON")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    results = [plan_row(row) for row in read_csv()]
    summary = summarize(results)
    wall = time.perf_counter() - start
    if args.json:
        json.dump({"source": str(RUNS_CSV.relative_to(REPO)), "sources": SOURCES,
                   "rows": [asdict(r) | {"priced_as": r.priced_as} for r in results], "summary": summary,
                   "wall_s": wall}, sys.stdout, indent=1)
        print()
        return 0
    if args.markdown:
        print(markdown(results))
        return 0
    refused = [r for r in results if r.skipped]
    print(f"{len(results)} published pipeline-parallel runs ({RUNS_CSV.relative_to(REPO)}): "
          f"{len(results) - len(refused)} priced, {len(refused)} refused by the planner\n")
    print_rows(results)
    if refused:
        print("Not priced (the planner's reasons, every mapping tried):")
        for r in refused:
            print(f"  {r.id} ({_layout(r)}, {r.schedule}, {r.precision}):")
            for text in r.refusals:
                print(f"    {text}")
        print()
    print("error = predicted / published tokens/s per GPU - 1 (positive: roofplan optimistic)")
    for name, s in summary.items():
        print(f"  {name:<16} n={s['count']}  median {_pct(s['median_error'])}  median |e| "  # type: ignore[arg-type]
              f"{_pct(s['median_abs_error'])}  worst {_pct(s['worst_error'])} ({s['worst_id']})  "  # type: ignore[arg-type]
              f"refused {s['refused']}")
    print(f"\n{wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
