"""Software stacks: the framework a training step runs under, and the time figures that belong to it.

A GPU profile (``hardware/profiles``) holds what was measured of the device: peak rates, kernel
benchmarks, links. What a framework makes of it (which attention kernel it calls, and a residual
fitted to that framework's own published runs) belongs to the stack, in ``hardware/stacks/<name>.yaml``
with its sources. ``on_stack`` lays a stack over a profile: the device as that stack runs it.

A residual (``step_efficiency``) is kept per (stack, GPU profile), fitted on a declared half of that
stack's published runs and reported on the other half (``benchmarks/published_fit.py`` for
llm-foundry). A stack without one is priced at the kernel-level roofline and says so.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cache
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hardware.errors import ConfigError
from hardware.files import parse_text, read_text_file
from hardware.kernels import AttentionCurve, AttentionKernel
from hardware.profile import Fraction, HardwareProfile, Source
from hardware.validation import describe_validation_error


class Stack(StrEnum):
    """The software stacks a plan can name (``--stack``, ``stack:`` in a model file)."""

    PYTORCH = "pytorch"  # eager PyTorch: the reference model and transformers (what `validate` runs)
    TORCHTITAN = "torchtitan"
    TORCHTITAN_COMPILE = "torchtitan-compile"
    LLM_FOUNDRY = "llm-foundry"
    MEGATRON = "megatron"  # Megatron-Core with Transformer Engine (NeMo, Megatron-Bridge)


DEFAULT_STACK = Stack.PYTORCH


class StackResidual(BaseModel):
    """A step efficiency fitted to this stack's published runs on one GPU profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    hardware: str = Field(min_length=1, description="the GPU profile's name")
    step_efficiency: Fraction = Field(description="share of the kernel-level roofline the stack's steps reach")
    fitted_on: str = Field(min_length=8, description="which runs it was fitted on, and where they are published")
    borrowed_from: str | None = Field(default=None, description="the profile whose fit this reuses, if not its own")


class StackCurves(BaseModel):
    """Attention figures of a kernel only this stack runs, fitted to its runs on one GPU profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    hardware: str = Field(min_length=1)
    curves: tuple[AttentionCurve, ...] = Field(min_length=1)


class SoftwareStack(BaseModel):
    """One stack: what it runs, what of it is priced, and the evidence its step times were checked on."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: Stack
    description: str = Field(min_length=3)
    attention_kernel: AttentionKernel | None = Field(
        default=None, description="the attention kernel the stack calls (None: what PyTorch's SDPA picks on the "
                                  "device, the profile's attention_kernel)")
    attention_kernel_by_hardware: dict[str, AttentionKernel] = Field(
        default_factory=dict, description="per GPU profile, where the stack picks another kernel there")
    residuals: tuple[StackResidual, ...] = ()
    residuals_borrowed_from: Stack | None = Field(
        default=None, description="a stack whose residuals this one reuses, declared (an eager stack with no "
                                  "published runs of its own takes another eager stack's fit)")
    borrow_reason: str = ""
    attention_curves: tuple[StackCurves, ...] = ()
    not_priced: tuple[str, ...] = Field(
        default=(), description="what the stack runs that the time model still prices as eager PyTorch")
    evidence: str = Field(min_length=3, description="the published runs this stack's step times were checked "
                                                    "against, and the errors (docs/validation.md), or that none were")
    sources: tuple[Source, ...] = Field(min_length=1)

    def residual(self, hardware: str) -> StackResidual | None:
        """This stack's residual on the profile named ``hardware``: its own fit, else the one it
        borrows (``residuals_borrowed_from``), else None (priced at the kernel-level roofline)."""
        own = next((r for r in self.residuals if r.hardware == hardware), None)
        if own is not None or self.residuals_borrowed_from is None:
            return own
        lender = load_stack(self.residuals_borrowed_from).residual(hardware)
        if lender is None:
            return None
        return lender.model_copy(update={
            "borrowed_from": f"{self.residuals_borrowed_from.value} on {lender.borrowed_from or hardware}",
            "fitted_on": f"borrowed from the {self.residuals_borrowed_from.value} stack ({self.borrow_reason}): "
                         f"{lender.fitted_on}"})

    def kernel_on(self, hw: HardwareProfile) -> AttentionKernel:
        """The attention kernel this stack runs on ``hw`` (the profile's default where it does not run there)."""
        kernel = self.attention_kernel_by_hardware.get(hw.name, self.attention_kernel)
        return kernel if kernel is not None and kernel in hw.attention_kernels else hw.attention_kernel


def _bundled_dir() -> Path:
    return Path(str(resources.files("hardware").joinpath("stacks")))


def parse_stack(value: str | Stack, field: str = "stack") -> Stack:
    """``value`` as a Stack, or one line naming ``field`` and the stacks there are."""
    try:
        return Stack(value)
    except ValueError:
        names = ", ".join(s.value for s in Stack)
        raise ConfigError(f"{field}: {value!r} is not a software stack; choose one of {names}") from None


@cache
def load_stack(name: str | Stack = DEFAULT_STACK) -> SoftwareStack:
    """A bundled stack by name (``hardware/stacks/<name>.yaml``)."""
    stack = parse_stack(name)
    path = _bundled_dir() / f"{stack.value}.yaml"
    data = parse_text(read_text_file(path, f"stack: {path}", "a stack YAML"), f"stack: {path}")
    try:
        return SoftwareStack.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, f"software stack {path}")) from None


_APPLIED: dict[tuple[int, Stack], tuple[HardwareProfile, HardwareProfile]] = {}
_APPLIED_MAX = 256


def on_stack(hw: HardwareProfile, stack: str | Stack = DEFAULT_STACK) -> HardwareProfile:
    """``hw`` as ``stack`` runs it: the stack's residual for this profile (1.0 where it has none),
    its attention kernel, and the attention figures it alone runs. The same object for the same
    profile object and stack (the planner's caches are keyed by identity); a profile already laid
    over this stack is returned as it is."""
    stack = parse_stack(stack)
    if hw.applied_stack is not None:
        if hw.applied_stack != stack.value:
            raise ValueError(f"{hw.name} is already priced for stack {hw.applied_stack}, not {stack.value}")
        return hw
    key = (id(hw), stack)
    hit = _APPLIED.get(key)
    if hit is not None and hit[0] is hw:
        return hit[1]
    spec = load_stack(stack)
    residual = spec.residual(hw.name)
    extra = tuple(c for group in spec.attention_curves if group.hardware == hw.name for c in group.curves)
    applied = hw.model_copy(update={
        "applied_stack": stack.value,
        "step_efficiency": residual.step_efficiency if residual is not None else 1.0,
        "attention_kernel": spec.kernel_on(hw),
        "attention_curves": (*hw.attention_curves, *extra),
    })
    if len(_APPLIED) >= _APPLIED_MAX:
        _APPLIED.clear()
    _APPLIED[key] = (hw, applied)
    return applied
