"""Where a plan's time comes from: the kernel figures behind its step time and MFU, for the report.

Each line names the figure the time model used for this plan and where it was measured: the
profile's ``figure_sources`` (YAML data next to the numbers), each attention curve's and each
collective curve's own source. A figure without a recorded source says so. A profile calibrated
from a bundled one (``hardware calibrate``) names its measurement for the figures calibration
replaces.
"""

from __future__ import annotations

from hardware.collectives import all_to_all_method, bus_bandwidth_bytes_per_s
from hardware.dtypes import ComputePrecision
from hardware.kernels import AttentionKernel, Direction, MemoryClass, pick_curve
from hardware.profile import MEMORY_CLASS_FIGURE, Figure, HardwareProfile
from hardware.ramps import Collective
from hardware.stack import DEFAULT_STACK, Stack, load_stack, on_stack
from planner.model.config import AttentionImpl, ModelConfig

NO_SOURCE = "no source recorded in the profile"
_CALIBRATED = {Figure.COMPUTE_EFFICIENCY, Figure.GEMM_HALF_DIM, Figure.MEMORY_EFFICIENCY, Figure.KERNEL_LAUNCH}
_CLASS_NAMES = {MemoryClass.NORM: "norms", MemoryClass.SOFTMAX: "softmax, cross-entropy",
                MemoryClass.ELEMENTWISE: "elementwise"}


def figure_source(hw: HardwareProfile, figure: Figure) -> str:
    """The profile's source for ``figure``; for a calibrated profile's measured figures, the measurement."""
    if figure in _CALIBRATED:
        measured = [s.fields for s in hw.sources if s.url.startswith("measured:")]
        if measured:
            return measured[-1]
    return hw.figure_sources.get(figure, NO_SOURCE)


def _attention_line(model: ModelConfig, seq_len: int, hw: HardwareProfile, direction: Direction) -> str:
    fused = model.attention is AttentionImpl.FLASH
    kernel = (model.attention_kernel or hw.attention_kernel) if fused else AttentionKernel.MATH
    curve = pick_curve(hw.attention_curves, kernel, fused, model.head_dim, direction)
    if curve is None:
        return f"{kernel.value}: no published figures for this device; priced at the GEMM efficiency"
    rate = curve.flops_per_s(seq_len) / 1e12
    causal = "causal" if fused else "full square"
    return (f"{kernel.value}, {causal}, head dim {curve.head_dim}, {seq_len} tokens: {rate:.0f} TFLOP/s "
            f"({curve.direction.value.replace('_', '+')}; {curve.source})")


def _attention_rows(model: ModelConfig, seq_len: int, hw: HardwareProfile) -> list[tuple[str, str]]:
    forward = _attention_line(model, seq_len, hw, Direction.FWD)
    backward = _attention_line(model, seq_len, hw, Direction.BWD)
    if forward == backward:
        return [("attention", forward)]
    return [("attention forward", forward), ("attention backward", backward)]


def _memory_rows(hw: HardwareProfile) -> list[tuple[str, str]]:
    tb_s = hw.hbm_bandwidth_bytes_per_s / 1e12
    rows = [("memory-bound ops", f"{hw.memory_efficiency:.0%} of {tb_s:.2f} TB/s for copies"
             + (" and every class not listed" if hw.memory_efficiency_by_class else "")
             + f" ({figure_source(hw, Figure.MEMORY_EFFICIENCY)})")]
    for kind, share in hw.memory_efficiency_by_class.items():
        rows.append((f"memory-bound: {_CLASS_NAMES.get(kind, kind.value)}",
                     f"{share:.0%} of {tb_s:.2f} TB/s ({figure_source(hw, MEMORY_CLASS_FIGURE[kind])})"))
    rows.append(("kernel launch", f"{hw.kernel_launch_s * 1e6:.1f} µs per kernel ({figure_source(hw, Figure.KERNEL_LAUNCH)})"))
    return rows


def _collective_rows(hw: HardwareProfile, gpus: int) -> list[tuple[str, str]]:
    gpus_per_node = hw.gpus_per_node
    inside = gpus <= gpus_per_node
    bus = bus_bandwidth_bytes_per_s(hw, gpus, gpus_per_node) / 1e9
    link = figure_source(hw, Figure.COLLECTIVE_EFFICIENCY if inside else Figure.NETWORK_EFFICIENCY)
    rows = [("collectives", f"NCCL ring/tree model, {bus:.0f} GB/s bus bandwidth over "
                            f"{'NVLink' if inside else 'every NIC of a node'} ({link}); NCCL's latency per step "
                            "(NVIDIA/nccl src/graph/tuning.cc @b6475625)")]
    rings = [r for r in hw.collective_ramps if r.collective is not Collective.ALL_TO_ALL]
    one_node = [r for r in rings if r.nodes == 1]
    across = sorted((r for r in rings if r.nodes > 1), key=lambda r: r.nodes)
    if one_node:
        rows.append(("collectives by size" if inside else "all-gather, reduce-scatter by size",
                     f"the one-node curve{'' if inside else ' plus the latency of the extra ring steps'} "
                     f"({one_node[0].source})"))
    if across and not inside:
        nodes = ", ".join(str(r.nodes) for r in across)
        rows.append(("all-reduce by size", f"curves measured on {nodes} nodes, interpolated in log(nodes) "
                                           f"({across[0].source})"))
    if not rings:
        rows.append(("collectives by size", "no published curve for this device: latency plus bytes at the bus rate"))
    return rows


def _all_to_all_row(hw: HardwareProfile, ep: int) -> tuple[str, str]:
    gpus_per_node = hw.gpus_per_node
    """Expert parallelism's all-to-all: which model prices it (published curve or the links' model)
    and where its achieved share was measured."""
    figure = Figure.ALL_TO_ALL_NETWORK_EFFICIENCY if ep > gpus_per_node else Figure.ALL_TO_ALL_EFFICIENCY
    return ("all-to-all (expert parallelism)",
            f"{all_to_all_method(hw, ep, gpus_per_node)} ({figure_source(hw, figure)})")


def stack_rows(hw: HardwareProfile, stack: Stack) -> list[tuple[str, str]]:
    """The software stack's rows: what it is, its residual on ``hw`` and where that was fitted, and
    what it runs that is still priced as eager PyTorch."""
    spec = load_stack(stack)
    rows = [("software stack", f"{spec.name.value}: {spec.description} (hardware/stacks/{spec.name.value}.yaml)")]
    residual = spec.residual(hw.name)
    if residual is None:
        rows.append(("in a real step", f"kernel-level roofline: no published {spec.name.value} run on {hw.name} "
                                       "was fitted, so no residual"))
    else:
        rows.append(("in a real step", f"kernels at {residual.step_efficiency:.0%} of their isolated speed, "
                                       f"{residual.fitted_on}; see checked against"))
    if spec.not_priced:
        rows.append(("priced as eager", "; ".join(spec.not_priced)))
    return rows


def checked_against(hw: HardwareProfile, stack: Stack) -> str:
    """The runs this stack's step times were checked on, and the device's own note."""
    evidence = load_stack(stack).evidence
    return f"{evidence}; {hw.time_validation}" if hw.time_validation else evidence


def time_sources(model: ModelConfig, seq_len: int, hw: HardwareProfile, precision: ComputePrecision,
                 gpus: int, ep: int = 1, stack: Stack = DEFAULT_STACK) -> list[tuple[str, str]]:
    """(what, figure and source) for each kernel class the step time is built from, on ``hw`` as
    ``stack`` runs it; ``ep``: the expert-parallel group's size (an all-to-all row when above 1)."""
    hw = on_stack(hw, stack)
    gemm = (f"{hw.compute_efficiency[precision]:.0%} of the {precision.value} peak for large GEMMs "
            f"({figure_source(hw, Figure.COMPUTE_EFFICIENCY)})")
    if hw.gemm_half_dim:
        gemm += (f"; x d/(d+{hw.gemm_half_dim:g}) per dimension for smaller ones "
                 f"({figure_source(hw, Figure.GEMM_HALF_DIM)})")
    rows = [("GEMMs", gemm), *_attention_rows(model, seq_len, hw), *_memory_rows(hw), *stack_rows(hw, stack)]
    if gpus > 1:
        rows.extend(_collective_rows(hw, gpus))
        if ep > 1:
            rows.append(_all_to_all_row(hw, ep))
        if hw.overlap_compute_slowdown:
            rows.append(("overlap", f"compute {hw.overlap_compute_slowdown:.0%} slower while collectives overlap it "
                                    f"({figure_source(hw, Figure.OVERLAP_COMPUTE_SLOWDOWN)})"))
    return rows
