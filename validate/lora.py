"""LoRA as peft runs it, measured: the reference model (or transformers' model) with peft's
adapters injected, one steady-state step under the live-storage tracker and FlopCounterMode.

peft 0.21.2 (``src/peft/mapping.py`` ``inject_adapter_in_model``; ``src/peft/tuners/lora``) replaces
each target ``nn.Linear`` by ``lora.Linear`` and marks only the adapters trainable. Its layers move
their adapters with ``Module.to``, which cannot swap fake parameters (``torch.utils.swap_tensors``
refuses tensors a fake mode holds weak references to), so these steps run on real CPU tensors: the
small models the tests use take milliseconds, and the tracker counts real storages as it counts
fake ones. ``inject_adapter_in_model`` moves each adapter to its base layer's device and float dtype
(``BaseTunerLayer._move_adapter_to_device_of_base_layer``; only ``PeftModel`` upcasts them to fp32),
as the planner prices them (``planner.finetune.lora``). QLoRA is not measured: bitsandbytes' 4-bit kernels run on
CUDA only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hardware.errors import ConfigError
from planner.finetune.config import FinetuneConfig
from planner.finetune.lora import lora_targets
from planner.graph.blocks import describe
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.precision import precision_spec
from planner.program.results import PlanResult
from validate.apply import configure_model, make_optimizer, make_scaler, param_dtype, train_step
from validate.flops import flop_counter
from validate.reference_model import build_model
from validate.report import Figures, Mode, ValidationReport
from validate.run import _predicted, build_report
from validate.simulate import shortened_step_note, steady_state_knobs
from validate.tracker import LiveStorageTracker, rounded_bytes


@dataclass(frozen=True)
class MeasuredLora:
    peak_allocated_bytes: int
    flops_per_step: float  # forward + backward of the step's micro-batches (FlopCounterMode)
    trainable_params: int
    frozen_params: int


def peft_targets(model: ModelConfig, finetune: FinetuneConfig) -> list[str]:
    """The names peft is given: the model file's, or (all-linear, which peft expands only for
    transformers' ``PreTrainedModel``) the planner's full names of every linear but the LM head."""
    if finetune.all_linear:
        return sorted(lora_targets(describe(model.model_copy(update={"finetune": None})), finetune, model.name))
    return list(finetune.target_modules)


def inject_lora(net: nn.Module, finetune: FinetuneConfig, targets: list[str] | str) -> nn.Module:
    """peft's adapters on ``net`` (in place); only they require grad."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError("validate: measuring a LoRA plan runs peft's adapters; install it: "
                          "python -m pip install peft") from None

    config = LoraConfig(r=finetune.rank, lora_alpha=finetune.alpha,  # type: ignore[arg-type]  # peft: int, used as a number
                        lora_dropout=finetune.dropout,
                        target_modules=targets)
    return inject_adapter_in_model(config, net)


def host_step_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's ``step`` counters that a GPU run keeps on the host: torch 2.13's
    AdamW makes each a CPU scalar unless fused or capturable (``torch/optim/adam.py``
    ``_init_group``: ``torch.tensor(0.0, dtype=_get_scalar_dtype())``). On the CPU they are
    storages the tracker counts, 512 B each; not device memory, so not in the planner's peak."""
    if any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups):
        return 0
    return sum(rounded_bytes(state["step"].untyped_storage().nbytes())
               for state in optimizer.state.values() if isinstance(state.get("step"), torch.Tensor))


def _measure(net: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[Knobs], None], knobs: Knobs,
             extra: list[torch.Tensor]) -> MeasuredLora:
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in net.parameters() if not p.requires_grad)
    tracker = LiveStorageTracker()
    tracker.track([*net.parameters(), *net.buffers(), *extra])
    short = steady_state_knobs(knobs)
    with tracker:
        step(short)  # warm-up: creates the optimizer state
        tracker.reset_peak()
        step(short)
        peak = tracker.peak_bytes - host_step_bytes(optimizer)
    counter = flop_counter()
    with counter:
        step(knobs.model_copy(update={"grad_accum_steps": 1}))
    flops = float(counter.get_total_flops()) * knobs.grad_accum_steps
    return MeasuredLora(peak_allocated_bytes=peak, flops_per_step=flops, trainable_params=trainable,
                        frozen_params=frozen)


def measure_reference(model: ModelConfig, training: TrainConfig, knobs: Knobs, seed: int = 0) -> MeasuredLora:
    """The reference model with ``model.finetune``'s adapters: peak and FLOPs of one step."""
    assert model.finetune is not None
    torch.manual_seed(seed)
    spec = precision_spec(knobs.precision)
    base = model.model_copy(update={"finetune": None})
    net = inject_lora(configure_model(build_model(base, param_dtype(spec)), knobs), model.finetune,
                      peft_targets(model, model.finetune))
    optimizer = make_optimizer(net, training)
    scaler = make_scaler(spec, "cpu")
    rows = knobs.micro_batch_size * knobs.grad_accum_steps
    ids = torch.randint(0, model.vocab_size, (rows, training.seq_len))
    targets = torch.randint(0, model.vocab_size, (rows, training.seq_len))
    with _cuda_dropout():
        return _measure(net, optimizer, lambda k: train_step(net, optimizer, ids, targets, k, spec, scaler), knobs,
                        [ids, targets])


@contextlib.contextmanager
def _cuda_dropout() -> Iterator[None]:
    """peft's ``lora_dropout`` (``nn.Dropout``) as CUDA runs it: ``native_dropout``, a bool mask
    saved (the CPU's ``F.dropout`` saves float noise instead), as the planner prices dropout."""
    from validate.implementations import _gpu_dropout

    original = F.dropout
    F.dropout = _gpu_dropout  # type: ignore[assignment]
    try:
        yield
    finally:
        F.dropout = original  # type: ignore[assignment]


def measure_hf(model: ModelConfig, training: TrainConfig, knobs: Knobs, seed: int = 0) -> MeasuredLora:
    """transformers' model for ``model`` (implementation hf) with peft's adapters: peak and FLOPs."""
    from validate.hf_model import _build, _fused, checkpoint_every, hf_step
    from validate.implementations import as_a_gpu_runs_it

    assert model.finetune is not None
    torch.manual_seed(seed)
    spec = precision_spec(knobs.precision)
    base = model.model_copy(update={"finetune": None})
    n_params = sum(p.numel for p in describe(base).params.values())
    targets: list[str] | str = "all-linear" if model.finetune.all_linear else list(model.finetune.target_modules)
    net = inject_lora(_build(base, knobs, n_params, checkpoint_every(knobs, model.n_layers)), model.finetune, targets)
    optimizer = make_optimizer(net, training)
    scaler = make_scaler(spec, "cpu")
    ids = torch.randint(0, model.vocab_size, (knobs.micro_batch_size * knobs.grad_accum_steps, training.seq_len))
    with as_a_gpu_runs_it(net, spec.autocast_dtype is not None, _fused(model)):
        return _measure(net, optimizer, lambda k: hf_step(net, optimizer, ids, k, spec, scaler), knobs, [ids])


# The largest base a LoRA plan is measured with: peft runs on real CPU tensors here, so its weights,
# the adapters' state and the activations take host memory (a tiny or small model, not a 7B one).
MAX_MEASURED_PARAM_BYTES = 2 * 2**30


def simulate_lora(plan: PlanResult) -> ValidationReport:
    """``validate --mode simulate`` of a LoRA plan: the reference model with peft's adapters, one
    steady-state step on real CPU tensors under the live-storage tracker and FlopCounterMode (peft
    cannot run under fake tensors: module docstring), against the plan's peak and hardware FLOPs."""
    model, training, knobs = plan.model.config, plan.training, plan.best.knobs
    if knobs.parallel.world_size > 1:
        raise ConfigError(f"validate: LoRA plans are measured on one GPU; this plan uses {knobs.parallel.world_size}")
    param_bytes = plan.best.estimate.n_params * param_dtype(precision_spec(knobs.precision)).itemsize
    if param_bytes > MAX_MEASURED_PARAM_BYTES:
        raise ConfigError(
            f"validate: a LoRA plan is measured with peft on real CPU tensors (peft cannot inject adapters under fake "
            f"tensors), and this model's weights take {param_bytes / 2**30:.1f} GiB, over the "
            f"{MAX_MEASURED_PARAM_BYTES / 2**30:.0f} GiB measured here; validate a smaller model file with the same "
            "finetune: section")
    measured = measure_reference(model, training, knobs)
    expected = _predicted(plan.best.estimate).model_copy(update={"step_time_s": None, "tokens_per_s": None})
    notes = ("simulate (LoRA): peft's adapters on the reference model, one step on real CPU tensors under the "
             "live-storage tracker (peft cannot run under fake tensors); AdamW's host-side step counters left out, "
             "as on a GPU; FLOPs compared as hardware FLOPs (recomputation included)",) + shortened_step_note(knobs)
    return build_report(plan, Mode.SIMULATE, f"cpu (real tensors, {os.cpu_count()} cores)", 1, expected,
                        Figures(peak_allocated_bytes=measured.peak_allocated_bytes,
                                model_flops_per_step=measured.flops_per_step), fits=True, notes=notes)
