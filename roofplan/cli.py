"""``plan``: the command line, a thin layer over ``roofplan.api``.

Exit codes: 0 success, 1 nothing fits (the estimate says so), 2 bad input. User errors print
one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from hardware.errors import PlannerError
from planner.errors import InfeasibleError
from roofplan.cli_support import (
    OneLineParser,
    SearchProgress,
    check_flag_sizes,
    check_run_flags,
    ends_quietly,
    output_console,
)
from roofplan.exports import check_export_paths, write_exports


def build_parser() -> argparse.ArgumentParser:
    """The `plan` command's parser, its options in groups of the help's order."""
    p = OneLineParser(prog="plan", description="Plan the fastest training configuration that fits in GPU memory.")
    _add_job_arguments(p)
    _add_training_arguments(p)
    _add_layout_arguments(p)
    _add_search_arguments(p)
    _add_output_arguments(p)
    return p


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The job: the model, the hardware and its memory cap, sequence length and global batch."""
    p.add_argument("--model", required=True, help="preset name, YAML file (model:/training:) or transformers config.json")
    p.add_argument("--hardware", default=None, help="profile name (see `hardware list`) or a profile YAML; default h100-sxm")
    p.add_argument("--hbm", default=None, help="memory cap per GPU: 80GB (10^9), 80GiB (2^30) or bytes; default the device's")
    p.add_argument("--headroom", default=None,
                   help="memory kept free of the cap: a fraction (0.05, 5%%) or a size (2GB); default none")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (overrides the training section)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (overrides)")


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    """How one GPU trains: micro-batch, precision, checkpointing, attention, implementation, optimizer."""
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward on one GPU (searched if omitted)")
    p.add_argument("--precision", default=None,
                   help="policy or comma list to search: fp32, tf32, bf16-mixed, fp16-mixed, bf16-true, fp8-mixed "
                        "(default: bf16-mixed, or fp16-mixed where the device has no bf16: policies that train "
                        "like fp32; bf16-true and fp8-mixed change numerics and are searched only when named)")
    p.add_argument("--checkpoint", default=None,
                   help="blocks to checkpoint: none, all, or indices like 0,2,5-9 (solved exactly if omitted)")
    p.add_argument("--checkpoint-policy", default=None, metavar="{full,attention,ops}",
                   help="how checkpointed blocks are checkpointed: the whole block, the attention core alone "
                        "(Korthikanti's selective recompute), or per op keeping --save-list's outputs (torchtitan's "
                        "selective op AC); searched if omitted")
    p.add_argument("--save-list", default=None,
                   help="with --checkpoint-policy ops: torchtitan (every second matmul, SDPA, reduce-scatter; the "
                        "default) or a comma list of matmul, attention, reduce_scatter (every one kept)")
    p.add_argument("--attention", choices=("flash", "eager"), default=None, help="attention implementation")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability")
    p.add_argument("--implementation", choices=("reference", "hf", "torchtitan"), default=None,
                   help="whose code runs the model (overrides the model file): reference (roofplan's reference "
                        "model), hf (transformers), torchtitan; each saves different tensors")
    p.add_argument("--finetune", default=None, metavar="{lora,qlora}",
                   help="train LoRA adapters on the frozen model (overrides the file's finetune: section); qlora is refused")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank r (default 8)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 8): updates scaled by alpha / r")
    p.add_argument("--lora-targets", default=None,
                   help="linears that get adapters, e.g. q_proj,v_proj (default) or all-linear")
    p.add_argument("--optimizer", choices=("adamw", "sgd-momentum", "sgd"), default=None)
    p.add_argument("--optimizer-impl", choices=("foreach", "fused"), default=None)
    p.add_argument("--stack", default=None,
                   help="the software stack the step runs under (overrides the model file's training.stack): "
                        "pytorch (eager, the default; what validate runs), torchtitan, torchtitan-compile, "
                        "llm-foundry, megatron (hardware/stacks)")


def _add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """How the GPUs are laid out: count, node size, ZeRO stage, tensor/context/expert parallelism."""
    p.add_argument("--gpus", type=int, default=1, help="GPUs in all (default 1): tensor-parallel groups of --tp, "
                                                         "data parallel over the groups")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node sharing its fast links (default: the hardware profile's, 8)")
    p.add_argument("--zero-stage", type=int, default=None,
                   help="ZeRO stage with several GPUs: 0 DDP, 1 sharded optimizer state (ZeroRedundancyOptimizer), "
                        "2 FSDP2 with each block's params kept from forward to backward, 3 FSDP2 re-gathering them "
                        "for backward (searched if omitted)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree (parallelize_module: colwise/rowwise linears, heads split; inside a "
                        "node); searched over the degrees the model and --gpus allow if omitted")
    p.add_argument("--cp", type=int, default=None,
                   help="context-parallel degree (torch's context_parallel: each sequence split over N GPUs, ring "
                        "attention, FSDP2 over the data- and context-parallel ranks); searched if omitted over "
                        "degrees that leave each GPU at least 4096 tokens of a sequence")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel degree on a mixture-of-experts model (torchtitan's: each MoE block's "
                        "experts split over N of FSDP2's data-parallel ranks, routed tokens exchanged by all-to-all); "
                        "searched if omitted over degrees dividing the experts and the data-parallel ranks")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline-parallel degree (torch.distributed.pipelining): the blocks split into N stages, "
                        "one per rank of a pipeline; the micro-batches are the accumulation steps. Searched if "
                        "omitted over degrees dividing the GPUs (1 included)")
    p.add_argument("--dp-replicate", type=int, default=None,
                   help="HSDP replicas (FSDP2 on a 2-D mesh, ZeRO-2/3): each GPU holds 1/(data-parallel ranks / N) of "
                        "the model state; sharded gradients all-reduced across the N replicas. Searched if omitted "
                        "across nodes (each replica whole nodes); 1 turns it off")
    p.add_argument("--pp-schedule", default=None, metavar="{gpipe,1f1b,...}",
                   help="pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zero-bubble, "
                        "zbv-zero-bubble, dualpipev; searched if omitted over 1f1b and interleaved-1f1b (1f1b "
                        "when every other knob is fixed)")
    p.add_argument("--pp-virtual", type=int, default=None,
                   help="pipeline stages per rank for the looped schedules (default 2); gpipe and 1f1b run 1, "
                        "zbv-zero-bubble and dualpipev 2")
    p.add_argument("--pp-layers", default=None, help="blocks per pipeline stage, e.g. 15,16,16,17 (default: even)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="tensor parallelism without sequence parallelism (norms, dropout and residuals on every "
                        "rank whole; all-reduces instead of all-gathers and reduce-scatters)")
    p.add_argument("--fsdp-grad-sync", default="every", metavar="{every,last}",
                   help="ZeRO-2/3 with accumulation: reduce-scatter gradients after every micro-batch (default) or "
                        "only the last (set_requires_gradient_sync(False) before the others: less traffic, every "
                        "unsharded gradient held in the reduce dtype until then)")


def _add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The optuna search: sampler, trials, seed, shared storage, checkpoint segments."""
    p.add_argument("--sampler", default="tpe", help="tpe (default), random or exhaustive")
    p.add_argument("--trials", type=int, default=30, help="sampler trials in this process (default 30)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (same seed, same result)")
    p.add_argument("--storage", default=None, help="optuna storage URL shared by workers, e.g. sqlite:///study.db")
    p.add_argument("--study-name", default=None, help="study to create or join in --storage")
    p.add_argument("--no-segments", action="store_true", help="do not consider multi-block checkpoint segments")


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """What comes out: the plan file, charts, a validation run, JSON."""
    p.add_argument("--out", default=None, help="write the plan file (JSON) that `validate` runs")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG charts into DIR: pareto.png (step time vs device memory of the plans found), "
                        "memory.png (the memory timeline of one step, allocated and device bytes, against the "
                        "cap) and, for a pipeline plan, pipeline.png (its schedule as a timeline per rank); when "
                        "nothing fits they show the smallest plan")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write the predicted step as a Chrome/Perfetto trace (JSON): streams, ops, collectives, memory")
    p.add_argument("--memory-snapshot", default=None, metavar="FILE",
                   help="write the predicted memory walk as a PyTorch memory snapshot (pickle) for memory_viz")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="write a self-contained HTML report with interactive charts (needs roofplan[html])")
    p.add_argument("--validate", action="store_true", help="then run the plan in PyTorch (see `validate`)")
    p.add_argument("--validate-mode", choices=("auto", "simulate", "run"), default="auto",
                   help="with --validate: simulate (fake tensors), run, or auto (run on CUDA if present, else simulate)")
    p.add_argument("--validate-device", choices=("cpu", "cuda"), default=None, help="with --validate --validate-mode run")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _run(args: argparse.Namespace) -> int:
    from planner.errors import ConfigError
    from roofplan import api

    check_flag_sizes(args)
    check_run_flags(args)
    model, training = api.load_model(
        args.model,
        seq_len=args.seq_len,
        global_batch_size=args.global_batch,
        attention=args.attention,
        dropout=args.dropout,
        implementation=args.implementation,
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl,
        stack=args.stack,
        finetune=args.finetune,
        lora_rank=args.lora_rank,
        lora_targets=args.lora_targets,
        lora_alpha=args.lora_alpha,
    )
    _check_outputs(args.out, args.plot)
    check_export_paths(args)
    if args.trials <= 0:
        raise ConfigError(f"--trials: must be positive, got {args.trials}")
    if args.storage and not args.study_name:
        raise ConfigError("--study-name: required with --storage, so that workers join the same study")
    with SearchProgress() as progress:
        result = _plan_or_closest(api, args, model, training, progress)
    if isinstance(result, InfeasibleError):  # reported once the progress bar is gone
        _report_infeasible(result, args)
        return 1
    if args.out:
        result.save(args.out)
    if args.plot:
        from roofplan.plots import write_plots

        written = write_plots(result, args.plot)
    exported = write_exports(result, args)
    report = None
    if args.validate:
        from roofplan.cli_support import StageProgress

        with StageProgress(sys.stderr.isatty(), "validate") as progress:
            report = api.validate(result, mode=args.validate_mode, device=args.validate_device, progress=progress)
    if args.json:
        data = result.model_dump(mode="json")
        if report is not None:
            data["validation"] = report.model_dump(mode="json")
        print(json.dumps(data, indent=2))
    else:
        from roofplan.render import print_report

        print_report(result, output_console())
        if args.out:
            print(f"plan written to {args.out} (run it: validate {args.out})")
        if args.plot:
            print(f"charts written: {', '.join(str(p) for p in written)}")
        for line in exported:
            print(f"written: {line}")
        if report is not None:
            from roofplan.validate_render import print_report as print_validation

            print_validation(report, output_console())
    fits = result.best.estimate.memory.fits
    return 0 if fits and (report is None or report.passed) else 1


def _plan_or_closest(api: Any, args: argparse.Namespace, model: Any, training: Any, progress: Any) -> Any:
    """Run the plan: the result, or the ``InfeasibleError`` when nothing fits."""
    try:
        return api.plan(
            model,
            training,
            args.hardware,
            args.hbm,
            precisions=args.precision,
            micro_batch_size=args.micro_batch,
            checkpoint=args.checkpoint,
            sampler=args.sampler,
            n_trials=args.trials,
            seed=args.seed,
            storage=args.storage,
            study_name=args.study_name,
            allow_segments=not args.no_segments,
            on_trial=progress.on_trial if progress else None,
            on_stage=progress.on_stage if progress else None,
            on_progress=progress.on_progress if progress else None,
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            zero_stage=args.zero_stage,
            fsdp_grad_sync=args.fsdp_grad_sync,
            tp=args.tp,
            cp=args.cp,
            ep=args.ep,
            checkpoint_policy=args.checkpoint_policy,
            save_list=args.save_list,
            sequence_parallel=not args.no_sequence_parallel,
            headroom=args.headroom,
            pp=args.pp,
            pp_schedule=args.pp_schedule,
            pp_layers=args.pp_layers,
            pp_virtual=args.pp_virtual,
            dp_replicate=args.dp_replicate,
        )
    except InfeasibleError as error:
        return error


def _report_infeasible(error: InfeasibleError, args: argparse.Namespace) -> None:
    """Nothing fits: the message, and with --json the smallest plan (``fits: false``), with --plot its charts."""
    print(f"plan: {error}", file=sys.stderr)
    if args.out:  # the smallest plan, so `validate` can check the bytes that did not fit
        if error.closest is not None:
            error.closest.save(args.out)  # type: ignore[attr-defined]
            print(f"the smallest plan (fits: false) written to {args.out}", file=sys.stderr)
        else:
            print(f"nothing written to {args.out}: no plan could be priced", file=sys.stderr)
    if args.json and error.closest is not None:
        print(json.dumps(error.closest.model_dump(mode="json"), indent=2))  # type: ignore[attr-defined]
    if args.plot and error.closest is not None:
        from roofplan.plots import write_plots

        written = write_plots(error.closest, args.plot)  # type: ignore[arg-type]
        print(f"charts of the smallest plan written: {', '.join(str(p) for p in written)}", file=sys.stderr)
    for line in write_exports(error.closest, args) if error.closest is not None else ():  # type: ignore[arg-type]
        print(f"of the smallest plan, written: {line}", file=sys.stderr)


def _check_outputs(out: str | None, plot: str | None) -> None:
    """Refuse unwritable destinations before the search runs, so no work is lost."""
    from pathlib import Path

    from planner.errors import ConfigError

    if out is not None:
        target = Path(out)
        if target.is_dir():
            raise ConfigError(f"--out: {out} is a directory; give a file name like {Path(out) / 'plan.json'}")
        if not target.parent.is_dir():
            raise ConfigError(f"--out: directory {target.parent} does not exist")
    if plot is not None and Path(plot).exists() and not Path(plot).is_dir():
        raise ConfigError(f"--plot: {plot} is a file; give a directory for the PNG charts")


def _one_line_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
    print(f"plan: warning: {message}", file=sys.stderr)


@ends_quietly("plan")
def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    from planner.errors import ConfigWarning

    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", ConfigWarning)
            default_show = warnings.showwarning

            def show(message: Warning | str, category: type[Warning], *rest: object, **kw: object) -> None:
                if issubclass(category, ConfigWarning):
                    _one_line_warning(message, category)
                else:
                    default_show(message, category, *rest, **kw)  # type: ignore[arg-type]

            warnings.showwarning = show
            return _run(args)
    except PlannerError as error:
        label = "plan: error:" if error.exit_code == 2 else "plan:"
        print(f"{label} {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
