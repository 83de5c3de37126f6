"""Plan every published llm-foundry MPT training run with its published settings; report the error.

    python benchmarks/published_runs.py            # skipped rows and the summaries
    python benchmarks/published_runs.py --rows     # also one line per run
    python benchmarks/published_runs.py --json     # per-row results and summaries as JSON on stdout

Data: ``tests/fixtures/published/llm_foundry_benchmarks.csv`` (mosaicml/llm-foundry,
scripts/train/benchmarking/README.md at 495218376830947dce625efabc4d86be7c47cc45, plus three H100 FP8
rows of 061f2c7ce64e655100286584a7629e2a09f827ba; see the file's header) and ``mpt_models.csv`` (the
MPT sizes). These are end-to-end Composer + PyTorch FSDP1 runs measured by MosaicML on 8 to 512
GPUs of three kinds; this script is the basis for calibrating the step-time model, and tunes
nothing. The error of a run is ``predicted / published - 1`` on tokens per second per GPU
(positive: roofplan is optimistic).

Model. Each row becomes a roofplan ``gpt2``-family model, which is MPT's layout: LayerNorm with
bias, GELU MLP with ``d_ff = expansion_ratio * d_model``, biases on every Linear (MPT's default
``no_bias=False``; the yamls do not change it), learned positions with ``max_seq_len`` = the row's
seq_len (the benchmark script sets model.max_seq_len to it), tied embeddings, vocab 50368, flash
attention (the runs used llm-foundry's triton flash-attention kernel). The parameter count must
equal the published NumParams: it does, exactly, for every row (the script asserts it), by
``L*(12*D^2 + 13*D) + (V + seq_len)*D + 2*D``.

Settings -> roofplan knobs:
- micro_batch_size, grad_accum -> ``micro_batch_size``, ``grad_accum_steps``; ``data_parallel`` = n_gpus,
  8 GPUs per node (``gpus_per_node=8``); training ``global_batch_size`` = the published one. Composer
  allows a micro-batch that does not divide the per-GPU batch (48 = 11+11+11+11+4); on every
  published row micro_batch x accum x GPUs equals the global batch, so each step is priced as it
  ran. Were it not so, the step with every micro-batch full (micro x accum x GPUs sequences) would
  be priced and its tokens/s per GPU used (the rate of the padded step), and the row marked.
- sharding FULL_SHARD -> ``zero_stage=3``, SHARD_GRAD_OP -> ``zero_stage=2``. roofplan models FSDP2
  (per-parameter sharding); the runs used FSDP1 (flat parameters, limit_all_gathers) - same
  traffic, different buffers.
- precision amp_bf16 with mp_mode DEFAULT, and bf16 with PURE -> ``bf16-mixed`` (under ZeRO-2/3:
  parameters gathered in bf16, fp32 shards, gradients reduced in fp32, fp32 AdamW). DEFAULT is that
  policy (param_dtype bf16, reduce fp32; Composer also autocasts). PURE reduces gradients (and keeps
  buffers) in bf16: its reduce-scatter moves half the bytes roofplan prices, so for PURE rows the
  prediction over-counts gradient traffic; nothing else differs (fp32 master weights and AdamW
  state either way).
- amp_fp8 -> ``fp8-mixed`` (TransformerEngine fp8 Linear layers in the runs). roofplan does not
  model fp8 under FSDP (ZeRO-2/3) and refuses it; those rows are listed as skipped with the
  planner's reason, never dropped silently.
- activation_checkpointing True -> every block checkpointed (llm-foundry checkpoints each MPTBlock);
  False -> none. activation_cpu_offload is False on every row (True would be skipped: not modelled).
- hardware: h100_80gb -> ``h100-sxm``, a100_80gb -> ``a100-sxm-80gb``, a100_40gb -> ``a100-sxm-40gb``;
  memory cap = the profile's whole device. The A100 tables state 1600 Gb/s RoCE between nodes (8 x
  200 Gb/s, the profile's one 200 Gb/s NIC per GPU); the H100 network is not stated (the profile
  assumes one 400 Gb/s NIC per GPU).

Each run is also checked against memory: a run that ran should be predicted to fit; the rows
predicted not to fit are listed. Known differences between the runs and what is priced (none is
corrected here): MPT's loss is flash-attn's fused cross-entropy (``loss_fn: fused_crossentropy``,
llm-foundry's default), while roofplan holds fp32 log-probabilities and their gradient at the loss
(B x T x V x 4 bytes several times): most rows predicted not to fit peak at the loss, without
checkpointing.

Fitted (``benchmarks/published_fit.py``), on the fit half only: per GPU type, ``step_efficiency`` and the causal rate of the
Triton attention kernel (its only published figures, the FlashAttention README's A100 bars, were
taken with a different Triton compiler and read 35% below what these runs imply; no H100 figure is
published; docs/kernel_benchmarks.md 2.7). Everything else is priced from kernel benchmarks. Uses only the public API (roofplan.api, planner.graph.params,
hardware.registry); never imports torch.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hardware.profile import HardwareProfile  # noqa: E402
from hardware.registry import load_hardware  # noqa: E402
from planner.graph.params import count_params  # noqa: E402
from roofplan import api  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "published"
RUNS_CSV = FIXTURES / "llm_foundry_benchmarks.csv"
MODELS_CSV = FIXTURES / "mpt_models.csv"
GPUS_PER_NODE = 8
RUNS_ATTENTION_KERNEL = "flash-triton"  # the runs' attn_impl: triton (mpt_models.csv)
TRITON_SOURCE = ("fitted: fit half of llm-foundry's published MPT runs (benchmarks/published_fit.py); "
                 "docs/kernel_benchmarks.md 2.7")

HARDWARE = {"h100_80gb": "h100-sxm", "a100_80gb": "a100-sxm-80gb", "a100_40gb": "a100-sxm-40gb"}
ZERO_STAGE = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}
PRECISION = {("amp_bf16", "DEFAULT"): "bf16-mixed", ("bf16", "PURE"): "bf16-mixed",
             ("amp_fp8", "DEFAULT"): "fp8-mixed"}


def read_csv(path: Path) -> list[dict[str, str]]:
    """Rows of a CSV whose first lines may be ``#`` comments."""
    with path.open(newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _bool(text: str) -> bool:
    if text not in ("True", "False", "true", "false"):
        raise ValueError(f"expected True/False, got {text!r}")
    return text.lower() == "true"


@dataclass
class Result:
    table: str
    model: str
    seq_len: int
    n_gpus: int
    gpu: str
    precision: str
    mp_mode: str
    sharding: str
    checkpointing: bool
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    num_params: int
    published_tokens_per_s_per_gpu: float
    published_mfu_pct: float
    published_step_s: float
    hardware: str = ""
    roofplan_precision: str = ""
    zero_stage: int = 0
    padded_step: bool = False
    skipped: str = ""  # the reason, when the run could not be planned
    predicted_tokens_per_s_per_gpu: float | None = None
    error: float | None = None  # predicted / published - 1
    predicted_step_s: float | None = None
    predicted_mfu_pct: float | None = None
    communication_s: float | None = None  # exposed (not overlapped) communication in the predicted step
    fits: bool | None = None
    device_gb: float | None = None
    hbm_cap_gb: float | None = None

    @property
    def multi_node(self) -> bool:
        return self.n_gpus > GPUS_PER_NODE

    @property
    def context(self) -> str:
        return "<=2k" if self.seq_len <= 2048 else "4-8k" if self.seq_len <= 8192 else ">=16k"


def build_model(arch: dict[str, str], seq_len: int, global_batch: int, name: str,
                attention_kernel: str = RUNS_ATTENTION_KERNEL) -> tuple[api.ModelConfig, api.TrainConfig]:
    """roofplan ModelConfig and TrainConfig of one MPT size at one context (through api.load_model)."""
    d_model = int(arch["d_model"])
    spec = {
        "model": {
            "name": name, "family": "gpt2",
            "n_layers": int(arch["n_layers"]), "d_model": d_model, "n_heads": int(arch["n_heads"]),
            "d_ff": int(arch["expansion_ratio"]) * d_model, "vocab_size": int(arch["vocab_size"]),
            "max_seq_len": seq_len,  # MPT's learned position table: max_seq_len = the run's seq_len
            "tie_embeddings": True,
            "qkv_bias": True, "attn_out_bias": True, "mlp_bias": True, "norm_bias": True,  # no_bias=False
            "norm": "layernorm", "mlp": "gelu", "positions": "learned", "attention": "flash", "attention_kernel": attention_kernel,
        },
        "training": {"seq_len": seq_len, "global_batch_size": global_batch, "stack": "llm-foundry"},
    }
    return api.load_model(spec)


def split_half(rows: list[dict[str, str]]) -> list[str]:
    """"fit" or "test" per row: alternate rows of each table in the published order, so both halves
    span every model size, context and GPU count of the table."""
    seen: dict[str, int] = {}
    halves = []
    for row in rows:
        index = seen.get(row["table"], 0)
        seen[row["table"]] = index + 1
        halves.append("fit" if index % 2 == 0 else "test")
    return halves


def plan_row(row: dict[str, str], models: dict[str, dict[str, str]],
             profiles: dict[str, HardwareProfile] | None = None,
             attention_kernel: str = RUNS_ATTENTION_KERNEL) -> Result:
    seq_len, n_gpus = int(row["seq_len"]), int(row["n_gpus"])
    mbs, accum, gbs = int(row["micro_batch_size"]), int(row["grad_accum"]), int(row["global_batch_size"])
    published = float(row["throughput_tokens_per_s_per_gpu"])
    result = Result(
        table=row["table"], model=row["model"], seq_len=seq_len, n_gpus=n_gpus, gpu=row["gpu"],
        precision=row["precision"], mp_mode=row["mp_mode"], sharding=row["sharding_strategy"],
        checkpointing=_bool(row["activation_checkpointing"]), micro_batch_size=mbs, grad_accum=accum,
        global_batch_size=gbs, num_params=int(row["num_params"]),
        published_tokens_per_s_per_gpu=published, published_mfu_pct=float(row["mfu"]),
        published_step_s=int(row["global_batch_tokens"]) / float(row["throughput_tokens_per_s"]),
    )
    arch = models[row["model"]]
    # the step as priced: the published global batch, or (uneven micro-batches) every micro-batch full
    priced_batch = mbs * accum * n_gpus
    result.padded_step = priced_batch != gbs
    model, training = build_model(arch, seq_len, priced_batch, f"mpt-{row['model']}", attention_kernel)
    n = count_params(model)
    assert n == result.num_params, (
        f"{row['table']} {row['model']} seq {seq_len}: roofplan counts {n:,} parameters, the table says "
        f"{result.num_params:,}: the architecture mapping is wrong")

    result.skipped = _mapping_refusal(row, result) or ""
    if result.skipped:
        return result
    n_layers = int(arch["n_layers"])
    knobs = api.Knobs(
        micro_batch_size=mbs, grad_accum_steps=accum, precision=result.roofplan_precision,
        data_parallel=n_gpus, zero_stage=result.zero_stage,
        checkpoint_blocks=tuple(range(n_layers)) if result.checkpointing else (),
    )
    try:
        hardware = (profiles or {}).get(result.hardware, result.hardware)
        estimate = api.estimate_plan(model, training, hardware, knobs,
                                     gpus_per_node=GPUS_PER_NODE).best.estimate
    except api.ConfigError as error:
        result.skipped = f"planner refused: {error}"
        return result
    result.predicted_tokens_per_s_per_gpu = estimate.tokens_per_s / n_gpus
    result.error = result.predicted_tokens_per_s_per_gpu / published - 1
    result.predicted_step_s = estimate.step_time_s
    result.predicted_mfu_pct = 100 * estimate.mfu
    result.communication_s = estimate.time.communication_s
    result.fits = estimate.memory.fits
    result.device_gb = estimate.memory.device_bytes / 1e9
    result.hbm_cap_gb = estimate.memory.hbm_cap_bytes / 1e9
    return result


def _mapping_refusal(row: dict[str, str], result: Result) -> str | None:
    """Why a row cannot be planned as published (a GPU, sharding, precision or offload roofplan does
    not map), or None; fills the row's mapped hardware, ZeRO stage and precision on the way."""
    if row["gpu"] not in HARDWARE:
        return f"no hardware profile for {row['gpu']}"
    result.hardware = HARDWARE[row["gpu"]]
    if row["sharding_strategy"] not in ZERO_STAGE:
        return f"sharding strategy {row['sharding_strategy']} not mapped"
    result.zero_stage = ZERO_STAGE[row["sharding_strategy"]]
    key = (row["precision"], row["mp_mode"])
    if key not in PRECISION:
        return f"precision {row['precision']}/{row['mp_mode']} not mapped"
    result.roofplan_precision = PRECISION[key]
    if _bool(row["activation_cpu_offload"]):
        return "activation CPU offload is not modelled"
    return None


GROUPS: dict[str, Callable[[Result], str]] = {
    "all": lambda r: "all runs",
    "GPU": lambda r: r.gpu,
    "precision": lambda r: f"{r.precision}/{r.mp_mode}",
    "context": lambda r: r.context,
    "nodes": lambda r: "single node (8)" if not r.multi_node else "multi-node (16-512)",
    "checkpointing": lambda r: "every block" if r.checkpointing else "none",
    "sharding": lambda r: r.sharding,
    "table": lambda r: r.table,
}
CONTEXT_ORDER = {"<=2k": 0, "4-8k": 1, ">=16k": 2}


def summarize(results: Iterable[Result]) -> list[dict[str, object]]:
    """Per group: count, median signed error, median |error|, range, runs predicted not to fit."""
    planned = [r for r in results if r.error is not None]
    out: list[dict[str, object]] = []
    for group, key in GROUPS.items():
        buckets: dict[str, list[Result]] = {}
        for r in planned:
            buckets.setdefault(key(r), []).append(r)
        names = sorted(buckets, key=lambda k: (CONTEXT_ORDER.get(k, 9), k))
        for name in names:
            rs = buckets[name]
            errors = [r.error for r in rs if r.error is not None]
            out.append({
                "group": group, "value": name, "count": len(rs),
                "median_error": statistics.median(errors),
                "median_abs_error": statistics.median(abs(e) for e in errors),
                "min_error": min(errors), "max_error": max(errors),
                "not_fit": sum(1 for r in rs if r.fits is False),
            })
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def print_rows(results: list[Result]) -> None:
    print(f"{'table':<27} {'model':>5} {'seq':>6} {'gpus':>4} {'mb x acc':>9} {'ckpt':>4} "
          f"{'published':>10} {'predicted':>10} {'error':>6} {'fits':>5} {'GB':>6}")
    for r in results:
        if r.error is None:
            continue
        print(f"{r.table:<27} {r.model:>5} {r.seq_len:>6} {r.n_gpus:>4} "
              f"{f'{r.micro_batch_size} x {r.grad_accum}':>9} {'all' if r.checkpointing else '-':>4} "
              f"{r.published_tokens_per_s_per_gpu:>10,.0f} {r.predicted_tokens_per_s_per_gpu:>10,.0f} "
              f"{_pct(r.error):>6} {'yes' if r.fits else 'NO':>5} {r.device_gb:>6.1f}")
    print()


def print_summary(summary: list[dict[str, object]]) -> None:
    print("error = predicted / published tokens/s per GPU - 1 (positive: roofplan optimistic)")
    print(f"{'group':<14} {'value':<27} {'n':>4} {'median':>7} {'med |e|':>8} {'min':>6} {'max':>6} {'not fit':>8}")
    last = None
    for s in summary:
        group = s["group"] if s["group"] != last else ""
        last = s["group"]
        print(f"{group!s:<14} {s['value']!s:<27} {s['count']:>4} {_pct(s['median_error']):>7} "  # type: ignore[arg-type]
              f"{_pct(s['median_abs_error']):>8} {_pct(s['min_error']):>6} {_pct(s['max_error']):>6} "  # type: ignore[arg-type]
              f"{s['not_fit']:>8}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", action="store_true", help="print one line per planned run")
    parser.add_argument("--json", action="store_true", help="print per-row results and summaries as JSON")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    models = {m["model"]: m for m in read_csv(MODELS_CSV)}
    rows = read_csv(RUNS_CSV)
    for name in {r["gpu"] for r in rows}:  # fail early on a missing profile
        if name in HARDWARE:
            load_hardware(HARDWARE[name])
    results = [plan_row(row, models) for row in rows]
    summary = summarize(results)
    wall = time.perf_counter() - start

    skipped = [r for r in results if r.skipped]
    not_fit = [r for r in results if r.fits is False]
    if args.json:
        json.dump({"source": str(RUNS_CSV.relative_to(REPO)), "n_rows": len(results), "n_planned":
                   len(results) - len(skipped), "n_skipped": len(skipped), "params_match": True,
                   "rows": [asdict(r) | {"multi_node": r.multi_node, "context": r.context} for r in results],
                   "summary": summary, "wall_s": wall}, sys.stdout, indent=1)
        print()
        return 0

    print(f"{len(results)} published runs ({RUNS_CSV.relative_to(REPO)}): {len(results) - len(skipped)} planned, "
          f"{len(skipped)} skipped; parameter count = NumParams on every row\n")
    if skipped:
        print("Skipped:")
        for r in skipped:
            print(f"  {r.table} {r.model} seq {r.seq_len} x {r.n_gpus} GPUs ({r.precision}): {r.skipped}")
        print()
    padded = [r for r in results if r.padded_step]
    if padded:
        print(f"{len(padded)} rows with uneven micro-batches: priced with every micro-batch full")
    if args.rows:
        print_rows(results)
    print_summary(summary)
    print(f"Predicted not to fit ({len(not_fit)} of {len(results) - len(skipped)} that ran):")
    for r in not_fit:
        print(f"  {r.table} {r.model} seq {r.seq_len} x {r.n_gpus} GPUs, micro-batch {r.micro_batch_size}, "
              f"checkpointing {'every block' if r.checkpointing else 'none'}: {r.device_gb:.1f} GB "
              f"> {r.hbm_cap_gb:.1f} GB")
    print(f"\n{wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
