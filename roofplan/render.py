"""Rich rendering of a plan: a one-line verdict, then the napkin math behind every number."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from hardware.units import format_bytes, format_count
from planner.memory.step import Category
from planner.parallel.context import describe_context_parallel, local_seq_len
from planner.parallel.expert import describe_expert_parallel
from planner.parallel.strategies import strategy_for
from planner.parallel.tensor import describe_tensor_parallel, rank_parameters
from planner.plan.checkpointing import CheckpointPolicy
from planner.plan.knobs import Knobs
from planner.plan.optimizer import optimizer_spec
from planner.plan.parallel_dims import layout_label
from planner.precision import precision_spec
from roofplan.render_state import rank_gradient_count, trained_label
from roofplan.time_sources import checked_against, time_sources

if TYPE_CHECKING:
    from planner.program.results import PlanResult


from roofplan.render_pipeline import stages_table  # noqa: E402  (after the TYPE_CHECKING block)

NOT_MODELLED = ("not modelled yet: CPU offload, HSDP beside context, expert or pipeline parallelism (modelled: data "
                "parallelism with DDP, ZeRO-1, FSDP2 or HSDP, tensor, sequence, context and expert parallelism, "
                "pipelines with DDP, ZeRO-1 or FSDP2 and every torch.distributed.pipelining schedule)")


def zero_label(knobs: Knobs) -> str:
    """``ZeRO-1 (DDP + ZeroRedundancyOptimizer)``: the ZeRO stage and how PyTorch runs it."""
    return f"ZeRO-{knobs.zero_stage} ({strategy_for(knobs.parallel).runtime})"


def sharding_label(knobs: Knobs) -> str:
    """``FSDP2 ZeRO-3 8 x TP 8 + SP``: the layout of the plan's GPUs."""
    return layout_label(knobs.parallel)


def _gpus(knobs: Knobs) -> str:
    gpus = knobs.parallel.world_size
    return "one GPU" if gpus == 1 else f"all {gpus} GPUs"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} µs"


def _cap(result: PlanResult) -> str:
    """``85.5 GB`` (with --headroom: ``85.5 GB less 4.3 GB headroom``)."""
    kept = f" less {format_bytes(result.headroom_bytes)} headroom" if result.headroom_bytes else ""
    return f"{format_bytes(result.hbm_cap_bytes)}{kept}"


def margin(result: PlanResult) -> str:
    """What the plan leaves free of the cap: ``5.4 GB (6.3%) free``."""
    return f"{format_bytes(result.margin_bytes)} ({result.margin_bytes / result.hbm_cap_bytes:.1%}) free"


def verdict(result: PlanResult) -> Text:
    est = result.best.estimate
    mem = est.memory
    if mem.fits:
        text = Text("FITS ", style="bold green")
        text.append(
            f"{format_bytes(mem.device_bytes)} of {_cap(result)}, {margin(result)} · "
            f"{_seconds(est.step_time_s)}/step · {est.tokens_per_s:,.0f} tokens/s · MFU {est.mfu:.1%}"
        )
    else:
        text = Text("DOES NOT FIT ", style="bold red")
        text.append(
            f"needs {format_bytes(mem.device_bytes)} on the device, cap {_cap(result)} · "
            f"{_seconds(est.step_time_s)}/step if it fit"
        )
    return text


def notes(result: PlanResult) -> list[Text]:
    """One line per caveat of the chosen plan: a precision that changes training numerics, and
    on several GPUs what the planner does not model yet."""
    k = result.best.knobs
    lines = []
    trades = precision_spec(k.precision).trades
    if trades is not None:
        lines.append(Text(f"{k.precision.value} trades numerics: {trades}", style="yellow"))
    if k.parallel.world_size > 1:
        lines.append(Text(NOT_MODELLED, style="yellow"))
    return lines


def _checkpoint_how(k: Knobs) -> str:
    """How the checkpointed blocks are checkpointed, for the configuration table."""
    if k.checkpoint_segments:
        return f", in {len(k.checkpoint_segments)} segments"
    if k.block_policies:
        counts = {p: 0 for p in CheckpointPolicy}
        for block in k.checkpoint_blocks:
            counts[k.policy_overrides.get(block, k.checkpoint_policy)] += 1
        names = {CheckpointPolicy.FULL: "whole", CheckpointPolicy.ATTENTION: "attention core only",
                 CheckpointPolicy.OPS: f"per op keeping {k.save_list.label}"}
        return ": " + ", ".join(f"{n} {names[p]}" for p, n in counts.items() if n)
    return {CheckpointPolicy.FULL: ", whole blocks",
            CheckpointPolicy.ATTENTION: ", the attention core only (selective recompute)",
            CheckpointPolicy.OPS: f", per op keeping {k.save_list.label}"}[k.checkpoint_policy]


def _title(result: PlanResult) -> Text:
    t = result.training
    gpus = result.best.knobs.parallel.world_size
    where = result.hardware.name if gpus == 1 else f"{gpus} × {result.hardware.name}"
    return Text.assemble(
        (f"{result.model.name}", "bold"),
        f" ({format_count(result.model.n_params)} params{trained_label(result)}) on ",
        (where, "bold"),
        f" · seq {t.seq_len} × global batch {t.global_batch_size} = {format_count(t.tokens_per_step)} tokens/step",
    )


def knobs_table(result: PlanResult) -> Table:
    k = result.best.knobs
    spec = precision_spec(k.precision)
    n_layers = result.model.config.n_layers
    table = Table(title="Configuration", show_header=False, title_justify="left")
    table.add_row("micro-batch × accumulation", f"{k.micro_batch_size} × {k.grad_accum_steps}")
    strategy = strategy_for(k.parallel)
    if strategy.shards_params and spec.autocast_dtype is not None:
        how = (f"{k.precision.value}: {spec.param_dtype.value} shards, params gathered and computed in "
               f"{spec.autocast_dtype.value} (FSDP2 MixedPrecisionPolicy, no autocast), gradients reduced in fp32")
    else:
        how = (f"{k.precision.value}: params {spec.param_dtype.value}, grads {spec.grad_dtype.value}, matmuls "
               f"{spec.matmul_precision.value}" + (f", autocast {spec.autocast_dtype.value}" if spec.autocast_dtype else ""))
    table.add_row("precision", how)
    blocks = sorted(k.checkpointed)
    ckpt = "none" if not blocks else ("all" if len(blocks) == n_layers else ",".join(map(str, blocks)))
    how = _checkpoint_how(k) if blocks else ""
    table.add_row("activation checkpointing", f"{len(blocks)} of {n_layers} blocks ({ckpt}){how}")
    t = result.training
    table.add_row("optimizer", f"{t.optimizer.value} ({t.optimizer_impl.value})")
    model = result.model.config
    if model.implementation.value != "reference" or model.loss is not None:
        from planner.graph.implementations import implementation_spec
        from planner.model.config import effective_loss

        table.add_row("implementation", f"{model.implementation.value} ({implementation_spec(model).library}), "
                                        f"{effective_loss(model).value} loss")
    dims = k.parallel
    if dims.world_size > 1:
        nodes = result.parallel.nodes
        table.add_row("layout", f"{dims.world_size} GPUs on {nodes} node{'s' if nodes > 1 else ''}: {layout_label(dims)}")
    if dims.fsdp_ranks > 1:
        over = f" (FSDP2 over them and the {dims.cp} context-parallel ranks)" if dims.cp > 1 else ""
        ranks = f"{dims.data_parallel} rank{'s' if dims.data_parallel > 1 else ''}"
        table.add_row("data parallel", f"{ranks}{over}, ZeRO-{k.zero_stage}: {strategy.describe(k)}")
    if dims.cp > 1:
        table.add_row("context parallel", describe_context_parallel(dims, t.seq_len))
    if dims.tp > 1:
        table.add_row("tensor parallel", describe_tensor_parallel(result.model.config, dims))
    if dims.ep > 1:
        table.add_row("expert parallel", describe_expert_parallel(dims, result.model.config))
    return table


_Row = tuple[RenderableType, RenderableType, RenderableType]


def memory_table(result: PlanResult) -> Table:
    """The memory table: static state, one micro-batch's activations and logits, the peak against the cap."""
    table = Table(title="Memory (per GPU, steady-state step)", title_justify="left")
    table.add_column("what")
    table.add_column("napkin math")
    table.add_column("bytes", justify="right")
    for row in (*_state_rows(result), *_activation_rows(result), *_peak_rows(result)):
        table.add_row(*row)
    return table


def _state_rows(result: PlanResult) -> list[_Row]:
    """Rows for parameters, gradients and optimizer state: count (this rank's share) x bytes each."""
    mem = result.best.estimate.memory
    k = result.best.knobs
    spec = precision_spec(k.precision)
    opt = optimizer_spec(result.training.optimizer, result.training.optimizer_impl)
    m, t = result.model.config, result.training
    n = format_count(result.model.n_params)
    dims = k.parallel
    ranks = dims.fsdp_ranks if strategy_for(dims).shards_params else dims.data_parallel
    strategy = strategy_for(dims)
    sharded = strategy.shards_params
    if dims.tp > 1 or dims.ep > 1:  # one rank's share of the model (norms whole on every rank)
        split = " x ".join(f"{name} {degree}" for name, degree in (("TP", dims.tp), ("EP", dims.ep)) if degree > 1)
        n = f"{format_count(rank_parameters(m, dims))} ({split})"
    if result.best.estimate.stages:  # the busiest pipeline stage's
        stage = max(result.best.estimate.stages, key=lambda s: s.peak_allocated_bytes)
        n = f"{format_count(stage.n_params)} (pipeline rank {stage.rank} of {dims.pp}{', TP ' + str(dims.tp) if dims.tp > 1 else ''})"
    per = f"{n} / {ranks}" if sharded else n
    grad_per = per if sharded or result.best.estimate.stages else rank_gradient_count(m, dims, per)
    grads = strategy.gradients(k) if ranks > 1 else spec.grad_dtype.value
    state_per = f"{n} / {ranks}" if strategy.shards_state else n
    trained = result.model.n_trainable_params
    if trained is not None:  # a fine-tuning plan (one GPU): the frozen base has no gradient nor state
        per = f"{n} ({format_count(result.model.n_params - trained)} frozen + {format_count(trained)} adapters)"
        grad_per = state_per = f"{format_count(trained)} adapters"
    return [
        ("parameters", f"{per} × {spec.param_bytes} B ({spec.param_dtype.value}"
         + (" shards; gathered copies are in the peak)" if sharded else ")"), format_bytes(mem.params_bytes)),
        ("gradients", f"{grad_per} × {spec.grad_bytes} B ({grads})", format_bytes(mem.grads_bytes)),
        ("optimizer state",
         f"{state_per} × {opt.state_tensors_per_param} × {spec.param_bytes} B ({t.optimizer.value})",
         format_bytes(mem.optimizer_bytes)),
    ]


def _activation_rows(result: PlanResult) -> list[_Row]:
    """Rows for what one micro-batch saves for backward and the logits kept at the end of forward."""
    from planner.model.config import LossKind, effective_loss

    mem = result.best.estimate.memory
    k = result.best.knobs
    m, t = result.model.config, result.training
    dims = k.parallel
    vocab = f"{m.vocab_size}/{dims.tp}" if dims.tp > 1 else f"{m.vocab_size}"
    loss = effective_loss(m)
    return [
        ("activations",
         ("saved for backward by the micro-batches in flight at the busiest pipeline rank's last forward, "
          if dims.pp > 1 else "saved for backward by one micro-batch ")
         + f"{'each ' if dims.pp > 1 else ''}of {k.micro_batch_size}×{local_seq_len(t.seq_len, dims)} tokens"
         + (f" (1/{dims.cp} of each sequence)" if dims.cp > 1 else ""),
         format_bytes(mem.activations_bytes)),
        ("logits",
         f"B·T·V = {k.micro_batch_size}·{local_seq_len(t.seq_len, dims)}·{vocab} × 4 B (fp32 log-probs, end of forward)"
         if loss is LossKind.PLAIN else f"none kept: the {loss.value} loss's chunks are transients of its forward",
         format_bytes(mem.logits_bytes)),
    ]


def _peak_rows(result: PlanResult) -> list[_Row]:
    """Rows for the peak (where it happens, by category), the device total and the cap."""
    mem = result.best.estimate.memory
    hw = result.hardware
    at = mem.at_peak
    parts = ", ".join(f"{c.value} {format_bytes(at[c])}" for c in Category if at.get(c))
    return [
        (Text("peak allocated", style="bold"),
         f"at {mem.peak_phase.value} / {mem.peak_op} (micro-batch {mem.peak_micro_batch + 1}): {parts}",
         Text(format_bytes(mem.peak_allocated_bytes), style="bold")),
        (Text("device", style="bold"),
         f"peak × {hw.fragmentation_factor:g} fragmentation + {format_bytes(hw.runtime_reserve_bytes, binary=True)} runtime reserve",
         Text(format_bytes(mem.device_bytes), style="bold green" if mem.fits else "bold red")),
        ("cap", "--hbm" if result.hbm_cap_bytes != hw.hbm_bytes else f"{hw.name} HBM ({hw.hbm_source or 'profile'})",
         format_bytes(result.hbm_cap_bytes)),
        *([("headroom", "--headroom: kept free, plans fit in the cap less it", format_bytes(result.headroom_bytes))]
          if result.headroom_bytes else []),
        ("margin", "cap - device: what the plan leaves free", format_bytes(result.margin_bytes)),
    ]


def time_table(result: PlanResult) -> Table:
    est = result.best.estimate
    tb = est.time
    hw = result.hardware
    spec = precision_spec(result.best.knobs.precision)
    peak = hw.peak_flops_per_s[spec.matmul_precision]
    table = Table(title="Time (roofline)", title_justify="left", show_header=False)
    k = result.best.knobs
    table.add_row("forward", f"{k.grad_accum_steps} × micro-batch", _seconds(tb.forward_s))
    table.add_row("backward", "≈ 2 × forward FLOPs", _seconds(tb.backward_s))
    table.add_row("recompute", "checkpointed blocks' forward again", _seconds(tb.recompute_s))
    table.add_row("optimizer", "memory-bound pass over params, grads, state", _seconds(tb.optimizer_s))
    if k.parallel.tp > 1:
        table.add_row("tensor-parallel collectives", "on the critical path, inside forward/backward (NCCL's model)",
                      _seconds(tb.tensor_parallel_s))
    if k.parallel.cp > 1:
        table.add_row("context-parallel collectives", "the ring's key/value all-gathers and dk/dv passes beyond the "
                      "attention blocks they overlap, inside forward/backward (NCCL's model)",
                      _seconds(tb.context_parallel_s))
    if k.parallel.ep > 1:
        table.add_row("expert-parallel all-to-alls", "routed rows to their experts' GPUs and back, forward and "
                      "backward, on the critical path (links' bandwidth: no published all-to-all curve)",
                      _seconds(tb.expert_parallel_s))
    if k.parallel.fsdp_ranks > 1:
        table.add_row("data-parallel collectives", "what they add beyond the compute they overlap (NCCL's model, "
                      "compute slowed while overlapped)", _seconds(tb.communication_s))
    table.add_row(Text("step", style="bold"), f"lower bound (pure roofline) {_seconds(tb.lower_bound_s)}", Text(_seconds(tb.step_time_s), style="bold"))
    table.add_row(
        "FLOPs",
        f"model {est.model_flops_per_step:.3e}, hardware {est.hardware_flops_per_step:.3e} (with recompute), "
        f"{_gpus(k)}",
        "",
    )
    gpus = f"{k.parallel.world_size} GPUs × " if k.parallel.world_size > 1 else ""
    table.add_row(
        "throughput",
        f"MFU = {est.model_flops_per_step:.3e} / ({_seconds(est.step_time_s)} × {gpus}{peak / 1e12:.1f} TFLOP/s "
        f"{spec.matmul_precision.value})",
        f"{est.tokens_per_s:,.0f} tok/s · MFU {est.mfu:.1%}",
    )
    table.add_row("limited by", f"{est.limiting_bound.value} (time-weighted over ops)", "")
    table.add_row("checked against", checked_against(hw, result.training.stack), "")
    return table


def sources_table(result: PlanResult) -> Table:
    """The kernel figures behind the step time and MFU, and where each was measured."""
    k = result.best.knobs
    rows = time_sources(result.model.config, result.training.seq_len, result.hardware,
                        precision_spec(k.precision).matmul_precision, k.parallel.world_size, ep=k.parallel.ep,
                        stack=result.training.stack)
    table = Table(title="Where the time figures come from", title_justify="left", show_header=False)
    for what, figure in rows:
        table.add_row(what, figure)
    return table


def ops_table(result: PlanResult, limit: int = 10) -> Table:
    est = result.best.estimate
    total = est.step_time_s
    table = Table(title="Where the time goes (per GPU, per step, summed over blocks)", title_justify="left")
    for column in ("op", "×", "FLOPs", "bytes", "FLOP/B", "bound", "time", "share"):
        table.add_column(column, justify="left" if column in ("op", "bound") else "right")
    for group in est.op_groups[:limit]:
        table.add_row(
            group.name,
            str(group.count),
            f"{group.flops:.2e}",
            format_bytes(group.bytes_moved),
            _intensity(group.intensity_flops_per_byte, group.flops),
            group.bound.value,
            _seconds(group.time_s),
            f"{group.time_s / total:.1%}",
        )
    return table


def _intensity(flops_per_byte: float | None, flops: float) -> str:
    """FLOP/B; an op group that moves no bytes has none: ∞ with FLOPs, – without."""
    if flops_per_byte is None:
        return "∞" if flops else "–"
    return f"{flops_per_byte:.0f}"


def alternatives_table(result: PlanResult) -> Table:
    table = Table(title="Next best plans that fit", title_justify="left")
    sharded = result.best.knobs.parallel.world_size > 1
    left = ("sharding", "precision", "checkpointed")
    columns = ("micro-batch × accum", *(("sharding",) if sharded else ()), "precision", "checkpointed", "device",
               "step", "vs best")
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    best = result.best.estimate.step_time_s
    n_layers = result.model.config.n_layers
    for entry in result.alternatives:
        k, est = entry.knobs, entry.estimate
        segments = f" in {len(k.checkpoint_segments)} segments" if k.checkpoint_segments else ""
        table.add_row(
            f"{k.micro_batch_size} × {k.grad_accum_steps}",
            *((sharding_label(k) + (f", {k.pp_schedule.value} v{k.pp_virtual}" if k.parallel.pp > 1 else ""),)
              if sharded else ()),
            k.precision.value,
            f"{len(k.checkpointed)}/{n_layers}{segments}",
            format_bytes(est.memory.device_bytes),
            _seconds(est.step_time_s),
            f"{est.step_time_s / best - 1:+.1%}",
        )
    return table


def search_line(result: PlanResult) -> Text:
    stats = result.search
    if stats is None:
        return Text("")
    shared = f" · study {stats.study_name} in {stats.storage}" if stats.storage else ""
    return Text(
        f"search: {stats.sampler} sampler, {stats.n_trials} trials ({stats.n_feasible} fit), "
        f"{stats.n_evaluated} configurations priced in {stats.wall_s:.2f} s · Pareto front: "
        f"{len(result.pareto)} plans (step time vs memory){shared}",
        style="dim",
    )


def report(result: PlanResult) -> Group:
    parts: list[RenderableType] = [_title(result), verdict(result), *notes(result), knobs_table(result),
                                   memory_table(result), *stages_table(result), time_table(result),
                                   sources_table(result), ops_table(result)]
    if result.alternatives:
        parts.append(alternatives_table(result))
    if result.search is not None:
        parts.append(search_line(result))
    return Group(*parts)


def print_report(result: PlanResult, console: Console | None = None) -> None:
    (console or Console()).print(report(result))
