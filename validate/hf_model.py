"""``validate --implementation hf``: run transformers' own model for a plan, not the reference.

The plan is priced again with ``implementation: hf`` (planner.graph.implementations) and transformers'
causal LM for the plan's model (``validate.implementations.hf_model``) runs the plan's
steady-state step: the precision policy (parameter dtype, autocast, GradScaler), the optimizer
and its implementation, ``grad_accum_steps`` micro-batches each ``model(input_ids=...,
labels=...).loss / A`` (the output, and with it the logits, dropped at once, as the Trainer
does), and activation checkpointing through ``activation_checkpointing_enable`` with
``use_reentrant=False`` (transformers' ``gradient_checkpointing_enable``): every layer, or every
n-th from the first (``every_n_layers``); other placements are refused. Measured as for the
reference model: ``simulate`` under fake tensors with the live-storage tracker and
FlopCounterMode (``as_a_gpu_runs_it``), ``run`` real steps on the GPU, or on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hardware.errors import ConfigError
from hardware.profile import HardwareProfile
from planner.model.config import AttentionImpl, Implementation, LossKind, ModelConfig, TrainConfig, effective_loss
from planner.plan.knobs import Knobs
from planner.precision import PrecisionSpec, precision_spec
from planner.program.estimate import Estimate, cached_graph, estimate
from planner.program.results import PlanResult
from validate.apply import make_optimizer, make_scaler, optimizer_state, param_dtype, precision_context
from validate.flops import flop_counter
from validate.implementations import HF_VERSION, as_a_gpu_runs_it, hf_model
from validate.report import Figures, Mode, ValidationReport
from validate.run import build_report, measure_steps
from validate.simulate import Progress, SimulatedStep, scaled_flops, shortened_step_note, steady_state_knobs
from validate.tracker import LiveStorageTracker


def as_implementation(model: ModelConfig, implementation: Implementation) -> ModelConfig:
    """``model`` run by ``implementation`` (validated again: one line for what it cannot run)."""
    from pydantic import ValidationError

    from hardware.validation import describe_validation_error

    try:
        return ModelConfig.model_validate({**model.model_dump(), "implementation": implementation})
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, "--implementation")) from None


def repriced(plan: PlanResult, implementation: Implementation) -> PlanResult:
    """``plan`` with its model run by ``implementation`` and its best configuration priced again."""
    if plan.model.config.implementation is implementation:
        return plan
    model = as_implementation(plan.model.config, implementation)
    est = estimate(model, plan.training, plan.hardware, plan.best.knobs, plan.hbm_cap_bytes)
    return plan.model_copy(update={"model": plan.model.model_copy(update={"config": model}),
                                   "best": plan.best.model_copy(update={"estimate": est}), "alternatives": ()})


def checkpoint_every(knobs: Knobs, n_layers: int) -> int | None:
    """transformers' ``every_n_layers`` for the plan's checkpointed blocks (None: no checkpointing);
    a placement transformers cannot express is refused with one line."""
    policy = getattr(knobs, "checkpoint_policy", None)
    if (knobs.checkpoint_segments or getattr(knobs, "block_policies", ())
            or (policy is not None and str(getattr(policy, "value", policy)) != "full")):
        raise ConfigError("validate --implementation hf: transformers checkpoints whole decoder layers one by one; "
                          "plan with --checkpoint all, none or every n-th block")
    blocks = tuple(sorted(knobs.checkpoint_blocks))
    if not blocks:
        return None
    for every in range(1, n_layers + 1):
        if blocks == tuple(range(0, n_layers, every)):
            return every
    raise ConfigError(f"validate --implementation hf: transformers checkpoints every layer or every n-th from the "
                      f"first (every_n_layers), not blocks {','.join(map(str, blocks))}; plan with --checkpoint all "
                      "or none")


def _check(plan: PlanResult, model: ModelConfig) -> int | None:
    if plan.best.knobs.parallel.world_size > 1:
        raise ConfigError("validate --implementation hf: runs one GPU's plan; this plan uses "
                          f"{plan.best.knobs.parallel.world_size} GPUs (validate the reference model for several)")
    if effective_loss(model) is not LossKind.PLAIN:
        raise ConfigError(f"validate --implementation hf: transformers runs the plain loss, not {model.loss.value if model.loss else ''}; "
                          "drop loss from the model section")
    if plan.best.knobs.precision.value == "fp8-mixed":
        raise ConfigError("validate --implementation hf: fp8 matmuls need torchao's Float8Linear; validate bf16-mixed")
    return checkpoint_every(plan.best.knobs, model.n_layers)


def _build(model: ModelConfig, knobs: Knobs, n_params: int, every: int | None) -> torch.nn.Module:
    net: Any = hf_model(model, param_dtype(precision_spec(knobs.precision)), n_params)
    if every is not None:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                            every_n_layers=every)
    return net


def hf_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, knobs: Knobs,
            spec: PrecisionSpec, scaler: torch.amp.GradScaler | None) -> None:
    """One optimizer step of ``grad_accum_steps`` micro-batches through transformers' loss."""
    b = knobs.micro_batch_size
    for micro in range(knobs.grad_accum_steps):
        rows = ids[micro * b:(micro + 1) * b]
        with precision_context(spec, ids.device.type):
            loss = net(input_ids=rows, labels=rows).loss / knobs.grad_accum_steps
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def simulate_hf(model: ModelConfig, training: TrainConfig, knobs: Knobs, n_params: int, every: int | None,
                progress: Progress | None = None, peak: bool = True, flops: bool = True
                ) -> tuple[SimulatedStep, tuple[str, ...]]:
    """transformers' model under fake tensors: a warm-up step, then a tracked steady-state step
    (at most three of its micro-batches, as ``validate.simulate``), FLOPs in steps of their own."""
    say = progress or (lambda _text: None)
    spec = precision_spec(knobs.precision)
    short = steady_state_knobs(knobs)
    with FakeTensorMode(allow_non_fake_inputs=False):
        say(f"building transformers' {model.family.value} under fake tensors")
        net = _build(model, knobs, n_params, every)
        optimizer = make_optimizer(net, training)
        scaler = make_scaler(spec, "cpu")
        ids = torch.randint(0, model.vocab_size, (knobs.micro_batch_size * knobs.grad_accum_steps, training.seq_len))
        tracker = LiveStorageTracker()
        tracker.track([*net.parameters(), *net.buffers(), ids])
        measured_peak = counted = None
        with as_a_gpu_runs_it(net, spec.autocast_dtype is not None, _fused(model)) as notes:
            if peak:
                with tracker:
                    say("warm-up step (creates the optimizer state)")
                    hf_step(net, optimizer, ids, short, spec, scaler)
                    tracker.reset_peak()
                    say(f"measured step ({short.grad_accum_steps} of {knobs.grad_accum_steps} micro-batches)")
                    hf_step(net, optimizer, ids, short, spec, scaler)
                    measured_peak = tracker.peak_bytes

            def count(step_knobs: Knobs) -> float:
                counter = flop_counter()
                with counter:
                    hf_step(net, optimizer, ids, step_knobs, spec, scaler)
                return float(counter.get_total_flops())

            if flops:
                say("counting FLOPs")
                counted = scaled_flops(count, knobs)
    return SimulatedStep(peak_allocated_bytes=measured_peak, flops_per_step=counted, params_bytes=0), notes


def _predicted(est: Estimate, timed: bool) -> Figures:
    return Figures(peak_allocated_bytes=est.memory.peak_allocated_bytes,
                   step_time_s=est.step_time_s if timed else None, tokens_per_s=est.tokens_per_s if timed else None,
                   model_flops_per_step=est.hardware_flops_per_step)


def validate_hf(plan: PlanResult, mode: Mode, device: str | None = None, steps: int = 5,
                profile: HardwareProfile | None = None, progress: Progress | None = None) -> ValidationReport:
    """Price ``plan`` for transformers' code and measure transformers' model running it."""
    model = as_implementation(plan.model.config, Implementation.HF)
    every = _check(plan, model)
    training, knobs = plan.training, plan.best.knobs
    hw = profile or plan.hardware
    est = estimate(model, training, hw, knobs, plan.hbm_cap_bytes)
    n_params = est.n_params
    notes: tuple[str, ...] = (f"implementation hf: transformers {HF_VERSION}'s {model.family.value} model ran the plan, "
                              "priced for it (planner.graph.implementations)",)
    if mode is Mode.SIMULATE:
        step, extra = simulate_hf(model, training, knobs, n_params, every, progress)
        measured = Figures(peak_allocated_bytes=step.peak_allocated_bytes, model_flops_per_step=step.flops_per_step)
        notes += extra + shortened_step_note(knobs)
        return build_report(plan, Mode.SIMULATE, f"cpu (fake tensors, {os.cpu_count()} cores)", 1,
                            _predicted(est, timed=False), measured, fits=True, notes=notes)
    return _run_hf(plan, model, est, every, device or "cuda", steps, profile, progress, notes)


def _run_hf(plan: PlanResult, model: ModelConfig, est: Estimate, every: int | None, device: str, steps: int,
            profile: HardwareProfile | None, progress: Progress | None, notes: tuple[str, ...]) -> ValidationReport:
    say = progress or (lambda _text: None)
    training, knobs = plan.training, plan.best.knobs
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device: cuda requested but torch sees no CUDA device; use --device cpu or --mode simulate")
    spec = precision_spec(knobs.precision)
    if profile is None and dev.type == "cpu":
        from validate.calibrate import calibrate

        say("calibrating the CPU on the plan's kernels")
        profile = calibrate("cpu", workload=cached_graph(model, knobs.micro_batch_size, training.seq_len, spec))
        est = estimate(model, training, profile, knobs, plan.hbm_cap_bytes)
        notes += ("time predicted with a CPU profile calibrated in this process on the plan's kernels",)
    label = f"cuda: {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    torch.manual_seed(0)
    with torch.device(dev):
        net = _build(model, knobs, est.n_params, every)
    optimizer = make_optimizer(net, training)
    scaler = make_scaler(spec, dev.type)
    ids = torch.randint(0, model.vocab_size, (knobs.micro_batch_size * knobs.grad_accum_steps, training.seq_len),
                        device=dev)

    def step() -> None:
        hf_step(net, optimizer, ids, knobs, spec, scaler)

    try:
        say(f"running transformers' model: warm-up and {steps} timed steps")
        with _gpu_semantics(net, dev, spec, model) as extra:
            times, peak, reserved = measure_steps(
                step, dev, steps, lambda: [*net.parameters(), *net.buffers(), ids, *optimizer_state(optimizer)])
            counter = flop_counter()
            with counter:
                step()
    except torch.OutOfMemoryError:
        allocated = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        return build_report(plan, Mode.RUN, label, 0, _predicted(est, True), Figures(), fits=False, oom=True,
                            allocated=allocated, notes=notes)
    median = statistics.median(times)
    measured = Figures(peak_allocated_bytes=int(peak), step_time_s=median,
                       tokens_per_s=training.tokens_per_step / median,
                       model_flops_per_step=float(counter.get_total_flops()), reserved_bytes=reserved)
    return build_report(plan, Mode.RUN, label, steps, _predicted(est, True), measured, fits=True, notes=notes + extra)


def _gpu_semantics(net: torch.nn.Module, dev: torch.device, spec: PrecisionSpec, model: ModelConfig
                   ) -> contextlib.AbstractContextManager[tuple[str, ...]]:
    """On a GPU transformers runs as it is; on the CPU as a GPU would (``as_a_gpu_runs_it``)."""
    if dev.type == "cuda":
        return contextlib.nullcontext(())
    return as_a_gpu_runs_it(net, spec.autocast_dtype is not None, _fused(model))


def _fused(model: ModelConfig) -> bool:
    return model.attention is AttentionImpl.FLASH
