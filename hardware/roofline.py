"""The roofline time of one op (Williams et al. 2009; lecture: time = max(compute, memory)).

    time = max(flops / (peak[precision] * eff_compute), bytes / (bw * eff_memory)) + launch

The pure lower bound drops the efficiencies and the launch overhead.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from hardware.dtypes import ComputePrecision
from hardware.kernels import MemoryClass
from hardware.profile import HardwareProfile


class Bound(StrEnum):
    COMPUTE = "compute"
    MEMORY = "memory"
    COMMUNICATION = "communication"  # a collective on the critical path (tensor/context parallelism)


class OpTime(BaseModel):
    """Roofline timing of one op execution."""

    model_config = ConfigDict(frozen=True)
    flops: float
    bytes_moved: float
    intensity_flops_per_byte: float
    compute_time_s: float
    memory_time_s: float
    time_s: float
    lower_bound_s: float
    bound: Bound
    communication_time_s: float = 0.0  # of ``time_s``: a collective the op waits for


def op_time(
    flops: float,
    bytes_moved: float,
    precision: ComputePrecision,
    hw: HardwareProfile,
    n_kernels: int = 1,
    achievable_flops_per_s: float | None = None,
    memory_class: MemoryClass = MemoryClass.STREAM,
) -> OpTime:
    """Time of one op on ``hw``: the slower of its compute and its memory traffic, plus launches.
    ``achievable_flops_per_s`` is the kernel's own rate (``hardware.kernels``), if known; else
    the profile's large-GEMM efficiency at ``precision``. ``memory_class`` picks the achieved share
    of HBM bandwidth of the op's kind of memory-bound kernel."""
    rate = achievable_flops_per_s or hw.achievable_flops_per_s(precision)
    compute_s = flops / rate if flops else 0.0
    memory_s = bytes_moved / hw.achievable_bandwidth_bytes_per_s(memory_class) if bytes_moved else 0.0
    ideal_compute_s = flops / hw.peak_flops_per_s[precision] if flops else 0.0
    ideal_memory_s = bytes_moved / hw.hbm_bandwidth_bytes_per_s if bytes_moved else 0.0
    return OpTime.model_construct(
        flops=flops,
        bytes_moved=bytes_moved,
        intensity_flops_per_byte=flops / bytes_moved if bytes_moved else float("inf"),
        compute_time_s=compute_s,
        memory_time_s=memory_s,
        time_s=max(compute_s, memory_s) + n_kernels * hw.kernel_launch_s,
        lower_bound_s=max(ideal_compute_s, ideal_memory_s),
        bound=Bound.COMPUTE if compute_s > memory_s or (compute_s == memory_s and flops > 0) else Bound.MEMORY,
    )
