"""``hardware calibrate``: measure this machine and write a profile ``plan --hardware`` accepts.

Three figures are measured, each as the fastest of timed repetitions after warm-up:

- achievable matmul FLOP/s per precision, at model-like shapes ((tokens, D) @ (D, F) and friends;
  2 FLOPs per multiply-add);
- achievable memory bandwidth: a large tensor copied (read + write);
- per-op overhead: a tiny autograd-tracked elementwise op, which on a CPU is nearly all dispatch.

On CUDA the bundled profile of the same device (matched by name) supplies the dense datasheet
peaks and the calibrated efficiencies become measured / peak; on a CPU there is no datasheet,
so the measured figures are the peaks and the efficiencies are 1.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hardware.dtypes import ComputePrecision
from hardware.profile import DeviceKind, HardwareProfile
from hardware.registry import bundled_names, load_hardware
from planner.graph.layer_graph import LayerGraph
from planner.ops.base import OpKind
from validate.kernel_curves import attention_curves, fit_gemm_half_dim, gemm_rates

_TORCH = {ComputePrecision.FP32: torch.float32, ComputePrecision.TF32: torch.float32,
          ComputePrecision.BF16: torch.bfloat16, ComputePrecision.FP16: torch.float16}
DEFAULT_SHAPES = ((2048, 2048, 2048), (4096, 4096, 4096))
CPU_SHAPES = ((1024, 512, 1536), (1024, 1024, 1024))


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, min_seconds: float = 0.05) -> float:
    """Seconds per call: the fastest of ``repeats`` batches sized to last about ``min_seconds``.

    The fastest, not the median: a calibration measures what the device can do, and on a shared
    machine a slower batch is another process's interference, not the device (the rule of
    Python's ``timeit``)."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(min_seconds / once))
    samples = [once]
    # a slow kernel (bf16 matmuls on a CPU without bf16 units: seconds each) gets about 2 s of
    # repeats, not ``repeats`` of them: its own timing already spans many scheduler ticks
    for _ in range(max(1, min(repeats, int(2.0 / (once * inner))))):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    return min(samples)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: torch.mm(a, b)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def matmul_flops_per_s(device: torch.device, precision: ComputePrecision, shapes: Sequence[tuple[int, int, int]],
                       repeats: int = 5) -> float:
    """Median achieved FLOP/s of (M, K) @ (K, N) over ``shapes`` at ``precision``."""
    dtype = _TORCH[precision]
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision is ComputePrecision.TF32
    try:
        rates = []
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds = _timed(_matmul(a, b), _sync(device), repeats)
            rates.append(2.0 * m * k * n / seconds)
        return statistics.median(rates)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def workload_flops_per_s(device: torch.device, graph: LayerGraph, repeats: int = 3) -> float:
    """Effective FLOP/s of the plan's own matmul-like kernels: every distinct linear shape
    (forward, input grad, weight grad) and the attention kernel forward + backward, each timed at
    its real shape, weighted by how often the step runs it. Executed FLOPs over total time."""
    dtype = _TORCH[graph.precision.matmul_precision] if graph.precision.autocast_dtype is None else \
        _TORCH[ComputePrecision(graph.precision.autocast_dtype.value)]
    sync = _sync(device)
    linear: dict[tuple[int, int, int], int] = {}
    attention: dict[tuple[int, int, int, int, int, bool], int] = {}
    flops = 0.0
    for op in graph.nodes:
        cost = op.cost
        if op.spec.kind is OpKind.LINEAR:
            tokens, i, o = cost.output.numel // op.spec.out_features, op.spec.in_features, op.spec.out_features
            for shape in ((tokens, i, o), (tokens, o, i), (i, tokens, o)):
                linear[shape] = linear.get(shape, 0) + 1
            flops += cost.fwd_exec + cost.bwd_exec
        elif op.spec.kind in (OpKind.ATTENTION_FLASH, OpKind.ATTENTION_EAGER):
            key = (graph.batch, op.spec.n_heads, op.spec.n_kv_heads, graph.seq_len, op.spec.head_dim,
                   op.spec.kind is OpKind.ATTENTION_FLASH)
            attention[key] = attention.get(key, 0) + 1
            flops += cost.fwd_exec + cost.bwd_exec
    seconds = 0.0
    for (rows, inner, cols), count in linear.items():
        a = torch.randn(rows, inner, device=device, dtype=dtype)
        b = torch.randn(inner, cols, device=device, dtype=dtype)
        seconds += count * _timed(_matmul(a, b), sync, repeats, min_seconds=0.02)
    for (batch, heads, kv, seq, head_dim, fused), count in attention.items():
        q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(batch, kv, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(batch, kv, seq, head_dim, device=device, dtype=dtype, requires_grad=True)

        def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, fused: bool = fused,
                 heads: int = heads, kv: int = kv, seq: int = seq) -> None:
            if fused:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)
            else:
                kk, vv = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
                mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
                out = torch.softmax((q @ kk.transpose(-2, -1)).masked_fill(mask, float("-inf")), -1) @ vv
            out.sum().backward()

        seconds += count * _timed(step, sync, repeats, min_seconds=0.02)
    return flops / seconds if seconds else matmul_flops_per_s(device, graph.precision.matmul_precision, CPU_SHAPES)


def elementwise_bytes_per_s(device: torch.device, dtype: torch.dtype, numel: int, repeats: int = 5,
                            pool_bytes: int = 128 << 20) -> float:
    """Achieved bytes/s of an elementwise product (2 reads + 1 write) in ``dtype`` on operands of
    ``numel`` elements: what the memory-bound ops of a plan see (bf16 on a CPU converts through
    fp32 and is slower per byte than a plain copy). Each call takes the next operands from a pool
    larger than the caches, as a training step touches fresh tensors op after op."""
    size = numel * torch.tensor([], dtype=dtype).element_size()
    pairs = max(2, -(-pool_bytes // (2 * size)))
    pool = [(torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype))
            for _ in range(pairs)]
    turn = iter(range(1 << 62))

    def step() -> None:
        a, b = pool[next(turn) % pairs]
        a.mul(b)

    seconds = _timed(step, _sync(device), repeats, min_seconds=0.02)
    return 3.0 * size / seconds


def bandwidth_bytes_per_s(device: torch.device, n_bytes: int, repeats: int = 5) -> float:
    """Achieved copy bandwidth, counting the read and the write."""
    numel = n_bytes // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), _sync(device), repeats)
    return 2.0 * src.numel() * 4 / seconds


def op_overhead_s(device: torch.device, repeats: int = 7) -> float:
    """Seconds of fixed cost per kernel, in the units the cost formulas count kernels in.

    A tiny biased linear layer's forward and backward move almost no bytes and do almost no
    FLOPs: its time is dispatch (views, autograd nodes, gradient accumulation, launches). The
    linear formula counts 1 forward and 3 backward kernels for it, so the overhead per counted
    kernel is that time / 4. On a GPU, where work is queued asynchronously, this is an upper bound.
    """
    layer = torch.nn.Linear(8, 8, device=device)
    x = torch.ones(4, 8, device=device, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()

    # the formula counts fwd 1 + bwd (2 + 1 for the bias); the .sum() and its backward are 2 more
    return _timed(step, _sync(device), repeats, min_seconds=0.05) / 6


def calibrate(device: str = "cpu", shapes: Sequence[tuple[int, int, int]] | None = None,
              precisions: Sequence[ComputePrecision] | None = None, name: str | None = None,
              workload: LayerGraph | None = None) -> HardwareProfile:
    """Measure ``device`` and return a profile built from the measurements.

    With ``workload`` (a plan's graph), the matmul rate of the plan's precision is measured on the
    plan's own kernels (``workload_flops_per_s``) rather than on generic shapes."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from hardware.errors import ConfigError

        raise ConfigError("--device: cuda requested but torch sees no CUDA device; use --device cpu")
    is_cuda = dev.type == "cuda"
    base = _matching_profile(torch.cuda.get_device_name(dev) if is_cuda else "")
    if precisions is None:
        precisions = _default_precisions(is_cuda, base)
    shapes = shapes or (DEFAULT_SHAPES if is_cuda else CPU_SHAPES)
    achieved = {p: matmul_flops_per_s(dev, p, shapes) for p in precisions}
    if workload is not None:
        achieved[workload.precision.matmul_precision] = workload_flops_per_s(dev, workload)
    bandwidth = _measured_bandwidth(dev, is_cuda, workload)
    overhead = op_overhead_s(dev)
    host = platform.node() or "this machine"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
    source = {"fields": f"every figure: measured by `hardware calibrate` on {host} ({stamp}), torch {torch.__version__}",
              "url": "measured:hardware-calibrate"}
    if is_cuda and base is not None:
        return _recalibrated(dev, base, achieved, bandwidth, overhead, name, source)
    return _measured_profile(dev, is_cuda, achieved, bandwidth, overhead, name, host, source)


def _default_precisions(is_cuda: bool, base: HardwareProfile | None) -> list[ComputePrecision]:
    """The precisions measured when none are asked for: on a GPU fp32, tf32, bf16 and fp16 (those the
    matching bundled profile supports), on a CPU fp32 and bf16."""
    if is_cuda:
        wanted = (ComputePrecision.FP32, ComputePrecision.TF32, ComputePrecision.BF16, ComputePrecision.FP16)
        return [p for p in wanted if base is None or base.supports(p)]
    return [ComputePrecision.FP32, ComputePrecision.BF16]


def _measured_bandwidth(dev: torch.device, is_cuda: bool, workload: LayerGraph | None) -> float:
    """Memory bandwidth in bytes/s: with a workload, of its memory-bound ops (its activation dtype, at
    its largest activation); else a plain copy (1 GiB on a GPU, 64 MiB on a CPU)."""
    if workload is None:
        return bandwidth_bytes_per_s(dev, 1 << 30 if is_cuda else 64 << 20)
    activations = [op.cost.output for op in workload.nodes if op.spec.block is not None]
    largest = max(activations, key=lambda t: t.numel)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(largest.dtype.value, torch.float32)
    return elementwise_bytes_per_s(dev, dtype, largest.numel)


def _recalibrated(dev: torch.device, base: HardwareProfile, achieved: dict[ComputePrecision, float], bandwidth: float,
                  overhead: float, name: str | None, source: dict[str, str]) -> HardwareProfile:
    """The bundled profile of this GPU with its efficiencies, kernel curves and launch overhead
    replaced by the measured ones (its peaks and links kept)."""
    data = base.model_dump(mode="json")
    data["compute_efficiency"] = {
        p.value: min(1.0, achieved[p] / base.peak_flops_per_s[p]) if p in achieved else base.compute_efficiency[p]
        for p in base.peak_flops_per_s
    }
    if ComputePrecision.BF16 in base.peak_flops_per_s:  # the shape law's large-GEMM rate replaces bf16's
        curves = _measured_curves(dev, base, overhead, source["fields"])
        data.update(curves, compute_efficiency={**data["compute_efficiency"],
                                                "bf16": curves["compute_efficiency"]["bf16"]})
    data["memory_efficiency"] = min(1.0, bandwidth / base.hbm_bandwidth_bytes_per_s)
    data["kernel_launch_s"] = overhead
    data["name"] = name or f"{base.name}-calibrated"
    data["time_validation"] = ""  # the bundled profile's comparison no longer describes these efficiencies
    data["sources"] = [*data["sources"], source]
    return HardwareProfile.model_validate(data)


def _measured_profile(dev: torch.device, is_cuda: bool, achieved: dict[ComputePrecision, float], bandwidth: float,
                      overhead: float, name: str | None, host: str, source: dict[str, str]) -> HardwareProfile:
    """A profile from the measurements alone (a CPU, or a GPU with no bundled profile): the achieved
    rates as peaks at efficiency 1, the measured bandwidth for memory and links."""
    total_memory = torch.cuda.get_device_properties(dev).total_memory if is_cuda else _host_memory_bytes()
    return HardwareProfile(
        name=name or (f"{dev.type}-calibrated"),
        description=f"measured on {host}: {torch.cuda.get_device_name(dev) if is_cuda else platform.processor() or 'CPU'}"
                    f" ({torch.get_num_threads()} threads)",
        kind=DeviceKind.GPU if is_cuda else DeviceKind.CPU,
        hbm_bytes=total_memory,
        hbm_bandwidth_bytes_per_s=bandwidth,
        peak_flops_per_s=achieved,
        intra_node_bandwidth_bytes_per_s=bandwidth,
        inter_node_bandwidth_bytes_per_s=12.5e9,
        collective_latency_s=50e-6,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        kernel_launch_s=overhead,
        runtime_reserve_bytes=0,
        fragmentation_factor=1.0,
        sources=(source,),  # type: ignore[arg-type]
    )


def _measured_curves(dev: torch.device, base: HardwareProfile, launch_s: float, source: str) -> dict[str, Any]:
    """The profile's kernel curves as this GPU measures them: the GEMM shape law (its large-GEMM
    bf16 efficiency and ``gemm_half_dim``) and the attention curves of the kernel SDPA runs here."""
    rate, half = fit_gemm_half_dim(gemm_rates(dev, torch.bfloat16), launch_s)
    curves = attention_curves(dev, torch.bfloat16, base.attention_kernel, source)
    kept = [c.model_dump(mode="json") for c in base.attention_curves if c.kernel is not base.attention_kernel]
    efficiency = min(1.0, rate / base.peak_flops_per_s[ComputePrecision.BF16])
    return {"gemm_half_dim": half, "attention_curves": [*(c.model_dump(mode="json") for c in curves), *kept],
            "compute_efficiency": {**base.model_dump(mode="json")["compute_efficiency"], "bf16": efficiency}}


def _matching_profile(device_name: str) -> HardwareProfile | None:
    """The bundled profile whose description names this GPU (``NVIDIA H200`` -> ``h200``)."""
    if not device_name:
        return None
    lowered = device_name.lower()
    best: HardwareProfile | None = None
    for name in bundled_names():
        profile = load_hardware(name)
        model = name.split("-")[0]  # h100, h200, a100, b200, l40s, mi300x
        if profile.kind == DeviceKind.GPU and model in lowered:
            if best is None or len(profile.name) < len(best.name):
                best = profile
    return best


def _host_memory_bytes() -> int:
    try:
        import os

        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30
