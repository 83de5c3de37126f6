"""``simulate``: run the plan's real PyTorch step under fake tensors; measure bytes and FLOPs.

Any model size, no GPU, seconds for a 7B step: the reference model and its optimizer are built
under ``FakeTensorMode`` on the CPU device (fake CUDA tensors crash the CPU build of torch), the
plan is applied exactly as on a GPU, and a steady-state step (the second, once the optimizer
state exists) is measured by the live-storage tracker (peak allocated bytes, rounded to the
CUDA allocator's 512-byte blocks) and by FlopCounterMode (forward + backward FLOPs).

A step of A micro-batches is measured with at most three of them (``steady_state_knobs``): the
first (gradients are allocated, or the FSDP2/DDP no-sync accumulation starts), one middle one
(every later middle micro-batch repeats its allocations exactly: same shapes, gradients already
there) and the last (the gradient reduction, then the optimizer step). Peak memory is the same
as the full step's; FLOPs are counted per micro-batch and for the optimizer step, and scaled to
A micro-batches (every micro-batch has the same shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from planner.model.config import AttentionImpl, ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.precision import precision_spec
from validate.apply import configure_model, make_optimizer, make_scaler, param_dtype, train_step
from validate.flops import flop_counter
from validate.reference_model import AttentionCore, build_model
from validate.tracker import LiveStorageTracker

if TYPE_CHECKING:
    from validate.memory_record import MemoryRecorder

GPU_ATTENTION_DROPOUT_NOTE = (
    "attention dropout is left out of the simulated fused attention: the CPU's fused kernel has no "
    "dropout (PyTorch would fall back to the math kernel and keep the T x T probabilities), a GPU's "
    "flash kernel keeps only its RNG state; the other dropouts are simulated")


def flash_with_dropout(model: ModelConfig) -> bool:
    """The configuration whose CPU attention differs from a GPU's (see ``as_on_a_gpu``)."""
    return model.dropout > 0 and model.attention is AttentionImpl.FLASH


def simulated_dropout_note(model: ModelConfig) -> tuple[str, ...]:
    """The report's note when ``as_on_a_gpu`` changed the simulated model."""
    return (GPU_ATTENTION_DROPOUT_NOTE,) if flash_with_dropout(model) else ()


def as_on_a_gpu(net: torch.nn.Module) -> bool:
    """Make the simulated attention keep what a GPU's fused attention keeps. With dropout, CPU
    SDPA drops to the math kernel, which saves the B x N x T x T probabilities and mask; flash
    attention on CUDA regenerates its dropout mask in the backward from a saved RNG state (Dao
    2023, FlashAttention-2, section 3.1). So the fused attention runs without dropout here; its
    saved bytes are then what the GPU keeps, but for a few bytes of RNG state. Where query/key and
    value head dims differ (MLA), the CPU's SDPA takes the math kernel (T x T probabilities kept) and
    a GPU's the memory-efficient one: the core calls that kernel's op directly. Returns whether
    dropout was removed (the report then says so)."""
    changed = False
    for module in net.modules():
        if isinstance(module, AttentionCore):
            module.efficient_kernel = True  # query/key and value head dims differ (MLA): see AttentionCore
        if isinstance(module, AttentionCore) and module.impl is AttentionImpl.FLASH and module.dropout > 0:
            module.dropout = 0.0
            changed = True
    return changed


# first, one middle (all later middles repeat it), last: see the module docstring
MEASURED_MICRO_BATCHES = 3

Progress = Callable[[str], None]


def steady_state_knobs(knobs: Knobs) -> Knobs:
    """The plan with at most ``MEASURED_MICRO_BATCHES`` micro-batches per step: the same peak."""
    return knobs.model_copy(update={"grad_accum_steps": min(knobs.grad_accum_steps, MEASURED_MICRO_BATCHES)})


def shortened_step_note(knobs: Knobs, flops_counted: bool = True) -> tuple[str, ...]:
    """The report's note on what was measured when the step was shortened."""
    measured = steady_state_knobs(knobs).grad_accum_steps
    if measured == knobs.grad_accum_steps:
        return ()
    flops = f"; FLOPs counted per micro-batch and scaled to {knobs.grad_accum_steps}" if flops_counted else ""
    return (f"measured a steady-state step with {measured} of its {knobs.grad_accum_steps} micro-batches (the first, "
            "one middle, the last): the middle micro-batches repeat the same allocations, so the peak is the full "
            f"step's{flops}",)


def scaled_flops(per_step: Callable[[Knobs], float], knobs: Knobs) -> float:
    """A step's FLOPs from two short counted steps: one micro-batch (f_mb + f_opt) and
    ``steady_state_knobs`` (a f_mb + f_opt), so A f_mb + f_opt without running A micro-batches."""
    short = steady_state_knobs(knobs)
    if short.grad_accum_steps == knobs.grad_accum_steps:  # the whole step is short: count it as it is
        return per_step(knobs)
    one = per_step(knobs.model_copy(update={"grad_accum_steps": 1}))
    several = per_step(short)
    per_micro = (several - one) / (short.grad_accum_steps - 1)
    return one + per_micro * (knobs.grad_accum_steps - 1)


@dataclass(frozen=True)
class SimulatedStep:
    peak_allocated_bytes: int | None  # None when not measured (``peak=False``)
    flops_per_step: float | None  # forward + backward (+ recomputation) of all micro-batches of one GPU
    params_bytes: int


def simulate_step(model: ModelConfig, training: TrainConfig, knobs: Knobs, warmup_steps: int = 1,
                  progress: Progress | None = None, peak: bool = True, flops: bool = True,
                  recorder: MemoryRecorder | None = None) -> SimulatedStep:
    """Measure one steady-state optimizer step of the planned configuration under fake tensors
    (with at most three of its micro-batches, see the module docstring): its peak (a warm-up step
    creates the optimizer state, the next is tracked) and its FLOPs (steps of their own under
    FlopCounterMode). ``peak=False`` or ``flops=False`` skips the steps only the other needs.
    ``recorder`` records the measured step's allocations (``validate.memory_record``)."""
    say = progress or (lambda _text: None)
    spec = precision_spec(knobs.precision)
    short = steady_state_knobs(knobs)
    rows = knobs.micro_batch_size * knobs.grad_accum_steps  # the whole step's batch is resident, as in a run
    with FakeTensorMode(allow_non_fake_inputs=False):
        say("building the model under fake tensors")
        net = configure_model(build_model(model, param_dtype(spec)), knobs)
        as_on_a_gpu(net)
        optimizer = make_optimizer(net, training)
        scaler = make_scaler(spec, "cpu")
        input_ids = torch.randint(0, model.vocab_size, (rows, training.seq_len))
        targets = torch.randint(0, model.vocab_size, (rows, training.seq_len))
        tracker = recorder.tracker() if recorder is not None and peak else LiveStorageTracker()
        tracker.track([*net.parameters(), *net.buffers(), input_ids, targets])
        params_bytes = tracker.live_bytes
        measured_peak = None
        if peak:
            with tracker:
                for _ in range(warmup_steps):
                    say(f"warm-up step ({short.grad_accum_steps} micro-batches; creates the optimizer state)")
                    train_step(net, optimizer, input_ids, targets, short, spec, scaler)
                tracker.reset_peak()
                say(f"measured step ({short.grad_accum_steps} of {knobs.grad_accum_steps} micro-batches)")
                if recorder is not None:
                    recorder.attach(net, optimizer, [input_ids, targets])
                    recorder.begin()
                train_step(net, optimizer, input_ids, targets, short, spec, scaler)
                if recorder is not None:
                    recorder.end()
                measured_peak = tracker.peak_bytes

        # FLOPs in steps of their own: FlopCounterMode's module hooks hold tensors and would
        # inflate the memory measured above
        def count(step_knobs: Knobs) -> float:
            counter = flop_counter()
            with counter:
                train_step(net, optimizer, input_ids, targets, step_knobs, spec, scaler)
            return float(counter.get_total_flops())

        counted = None
        if flops:  # FlopCounterMode counts matmuls and attention: alike with or without optimizer state
            say("counting FLOPs")
            counted = scaled_flops(count, knobs)
    return SimulatedStep(peak_allocated_bytes=measured_peak, flops_per_step=counted, params_bytes=params_bytes)
