"""What to tell a user when nothing fits: the smallest plan, where its bytes go, what would fit."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hardware.profile import HardwareProfile
from hardware.registry import bundled_names, load_hardware
from hardware.units import format_bytes
from planner.memory.step import Category
from planner.memory.types import Phase
from planner.plan.knobs import Knobs
from planner.plan.layouts import MOST_SHARDING, NOT_MODELLED_NOTE
from planner.plan.parallel_dims import layout_label
from planner.program.results import PlanEntry


@dataclass(frozen=True)
class FusedFit:
    """A plan priced with ``--optimizer-impl fused``: one that fits (``fits``), or the smallest
    plan priced with it when no plan fits with it either."""

    knobs: Knobs
    device_bytes: int
    fits: bool


def reserve_exceeds_cap(hw: HardwareProfile, cap_bytes: int) -> str | None:
    """The runtime reserve alone needs more than the cap (then nothing fits, on any number of
    GPUs): says so, or None."""
    if hw.runtime_reserve_bytes < cap_bytes:
        return None
    return (f"the runtime reserve (CUDA context, cuBLAS/NCCL workspaces: runtime_reserve_bytes of {hw.name}) of "
            f"{format_bytes(hw.runtime_reserve_bytes)} ({format_bytes(hw.runtime_reserve_bytes, binary=True)}) alone "
            f"exceeds the {format_bytes(cap_bytes)} cap, before any parameter or activation")


def infeasible_message(hardware_name: str, cap_bytes: int, closest: PlanEntry, scale_out: str | None = None,
                       headroom_bytes: int = 0, fused: FusedFit | None = None) -> str:
    """Several lines: the smallest device footprint found, its breakdown, and what would fit it
    (``cap_bytes`` is what plans must fit in: the cap less ``headroom_bytes``; ``fused``: the
    request priced with the fused optimizer, when it was)."""
    est, knobs = closest.estimate, closest.knobs
    mem = est.memory
    hw = load_hardware(hardware_name)
    kept = f" (the cap less {format_bytes(headroom_bytes)} of --headroom)" if headroom_bytes else ""
    reserve = reserve_exceeds_cap(hw, cap_bytes)
    if reserve is not None:
        return (f"nothing fits in {format_bytes(cap_bytes)}{kept} on {hardware_name}: {reserve}\n"
                f"  to fit: a cap of at least {format_bytes(mem.device_bytes)}, what the smallest plan needs with it "
                f"(--hbm {math.ceil(mem.device_bytes / 1e9)}GB)")
    n_blocks = len(knobs.checkpointed)
    segments = f", {len(knobs.checkpoint_segments)} checkpoint segments" if knobs.checkpoint_segments else ""
    parts = " + ".join(f"{c.value} {format_bytes(b)}" for c, b in mem.at_peak.items() if b > 0 and c in Category)
    dims = knobs.parallel
    sharding = f", {dims.world_size} GPUs as {layout_label(dims)}" if dims.world_size > 1 else ""
    lines = [
        f"nothing fits in {format_bytes(cap_bytes)}{kept} on {hardware_name}: the smallest plan needs "
        f"{format_bytes(mem.device_bytes)} on the device",
        f"  smallest plan (the least memory of any plan the request allows): micro-batch {knobs.micro_batch_size} x "
        f"{knobs.grad_accum_steps} accumulation, {knobs.precision.value}, {n_blocks} blocks checkpointed{segments}"
        f"{sharding}",
        f"  its peak {format_bytes(mem.peak_allocated_bytes)} at {mem.peak_phase.value} / {mem.peak_op}: {parts}",
        f"  device = peak x {hw.fragmentation_factor:g} fragmentation + {format_bytes(hw.runtime_reserve_bytes, binary=True)} reserve",
    ]
    if mem.device_bytes <= hw.hbm_bytes:  # the device has it: only the user's cap is too low
        lines.append(f"  to fit: a cap of at least {format_bytes(mem.device_bytes)} "
                     f"(--hbm {math.ceil(mem.device_bytes / 1e9)}GB; the {hardware_name} has {format_bytes(hw.hbm_bytes)})")
    temporaries = mem.at_peak.get(Category.TEMPORARIES, 0)
    if fused is not None:
        lines.append(_fused_line(fused))
    elif mem.peak_phase is Phase.OPTIMIZER and temporaries > 0:
        without = int((mem.peak_allocated_bytes - temporaries) * hw.fragmentation_factor) + hw.runtime_reserve_bytes
        lines.append(
            f"  the peak is the foreach optimizer's parameter-sized temporaries: with --optimizer-impl fused the "
            f"step itself would need about {format_bytes(without)} (the forward/backward peak may then decide)"
        )
    fitting = []
    for name in bundled_names():
        other = load_hardware(name)
        if other.kind == hw.kind and other.supports(hw.precisions[0]):
            need = int(mem.peak_allocated_bytes * other.fragmentation_factor) + other.runtime_reserve_bytes
            if need <= other.hbm_bytes:
                fitting.append(f"{name} ({format_bytes(other.hbm_bytes)})")
    if fitting:
        lines.append(f"  devices whose memory holds that plan: {', '.join(fitting)}")
    state = format_bytes(mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes)
    if scale_out:
        lines.append(f"  or more GPUs: {scale_out}")
    elif fused is None or not fused.fits:  # the fused optimizer fits it: more GPUs were not needed
        lines.append(
            f"  more GPUs do not help: even {MOST_SHARDING}, leaves activations, logits and a gathered block per GPU "
            f"above the cap (model state on one GPU here {state}); shorten the sequence, or fix a larger --cp "
            f"{NOT_MODELLED_NOTE}".rstrip()
        )
    return "\n".join(lines)


def _fused_line(fused: FusedFit) -> str:
    """What ``--optimizer-impl fused`` does to the request, measured."""
    what = ("fused=True: the same update in one kernel, without the parameter-sized temporaries of foreach, which "
            "torch runs unless asked")
    if not fused.fits:
        return (f"  with --optimizer-impl fused ({what}) this plan would still need {format_bytes(fused.device_bytes)}, "
                f"and no plan of the request fits with it")
    k = fused.knobs
    dims = k.parallel
    layout = f", {dims.world_size} GPUs as {layout_label(dims)}" if dims.world_size > 1 else ""
    return (f"  to fit: --optimizer-impl fused ({what}): a plan then needs {format_bytes(fused.device_bytes)} "
            f"(micro-batch {k.micro_batch_size} x {k.grad_accum_steps}, {k.precision.value}, "
            f"{len(k.checkpointed)} blocks checkpointed{layout}); run it again with that flag")
