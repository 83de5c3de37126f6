"""HardwareProfile: one accelerator's figures, loaded from cited YAML data.

Every number the time and memory models use comes from a profile, never from a code constant:
dense peak FLOP/s per matmul precision (never the sparsity figure), HBM capacity and bandwidth,
interconnect bandwidths, achievable-fraction efficiencies, kernel-launch overhead, the runtime
reserve (CUDA context, library workspaces) and the allocator's fragmentation allowance.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from hardware.dtypes import ComputePrecision
from hardware.errors import ConfigError
from hardware.kernels import AttentionCurve, AttentionKernel, MemoryClass
from hardware.ramps import CollectiveRamp
from hardware.units import parse_bytes


class DeviceKind(StrEnum):
    GPU = "gpu"
    CPU = "cpu"


class Figure(StrEnum):
    """The profile figures a plan's time is built from, whose sources the report names
    (``figure_sources``; attention curves and collective ramps carry their own)."""

    COMPUTE_EFFICIENCY = "compute_efficiency"
    GEMM_HALF_DIM = "gemm_half_dim"
    MEMORY_EFFICIENCY = "memory_efficiency"
    MEMORY_NORM = "memory_norm"
    MEMORY_SOFTMAX = "memory_softmax"
    MEMORY_ELEMENTWISE = "memory_elementwise"
    KERNEL_LAUNCH = "kernel_launch"
    COLLECTIVE_EFFICIENCY = "collective_efficiency"
    NETWORK_EFFICIENCY = "network_efficiency"
    ALL_TO_ALL_EFFICIENCY = "all_to_all_efficiency"
    ALL_TO_ALL_NETWORK_EFFICIENCY = "all_to_all_network_efficiency"
    OVERLAP_COMPUTE_SLOWDOWN = "overlap_compute_slowdown"
    STEP_EFFICIENCY = "step_efficiency"


MEMORY_CLASS_FIGURE = {MemoryClass.STREAM: Figure.MEMORY_EFFICIENCY, MemoryClass.NORM: Figure.MEMORY_NORM,
                       MemoryClass.SOFTMAX: Figure.MEMORY_SOFTMAX, MemoryClass.ELEMENTWISE: Figure.MEMORY_ELEMENTWISE}


class Source(BaseModel):
    """Where a figure comes from: which fields it supports and a link."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    fields: str = Field(description="which profile fields this source supports")
    url: str = Field(min_length=8)


Fraction = Annotated[float, Field(gt=0, le=1)]
PositiveFloat = Annotated[float, Field(gt=0)]


class HardwareProfile(BaseModel):
    """One device (one GPU, or one CPU socket) and the node it sits in."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, description="profile name used by --hardware")
    description: str = ""
    kind: DeviceKind = DeviceKind.GPU
    hbm_bytes: int = Field(gt=0, description="device memory capacity (accepts 80GB / 80GiB / bytes)")
    hbm_source: str = Field(default="", description="where hbm_bytes comes from (e.g. the driver-reported total, "
                            "nvidia-smi memory.total), for messages about the cap")
    marketed_hbm_gb: float | None = Field(
        default=None, gt=0, description="the memory the device is sold as, in GB as its datasheet writes it (80 for "
        "an H100 80GB): a --hbm cap of that size, read as GB or GiB, means the whole device")
    hbm_bandwidth_bytes_per_s: PositiveFloat
    peak_flops_per_s: dict[ComputePrecision, PositiveFloat] = Field(
        description="dense (non-sparse) peak FLOP/s of a matmul at each precision the device runs"
    )
    gpus_per_node: int = Field(
        default=8, gt=0, description="devices that share the node's fast links (an HGX/DGX board's 8 GPUs on NVLink "
        "switches); ranks of a group beyond it talk over the NICs. `plan --gpus-per-node N` sets it per run")
    intra_node_bandwidth_bytes_per_s: PositiveFloat = Field(
        description="per-GPU unidirectional bandwidth to its node peers (NVLink, xGMI, PCIe)"
    )
    inter_node_bandwidth_bytes_per_s: PositiveFloat = Field(
        description="per-GPU unidirectional bandwidth to other nodes (InfiniBand, RoCE)"
    )
    collective_latency_s: PositiveFloat = Field(
        description="base latency of one NCCL collective (tuning.cc baseLat, ring/Simple: 8.4 µs)"
    )
    intra_node_hop_latency_s: float = Field(
        default=3.4e-6, ge=0, description="latency of one ring step inside a node (tuning.cc hwLat NVLink ring/Simple)"
    )
    inter_node_hop_latency_s: float = Field(
        default=14e-6, ge=0, description="latency of one ring step across nodes (tuning.cc hwLat NET ring/Simple)"
    )
    collective_efficiency: Fraction = Field(
        default=1.0, description="NCCL's achieved share of the intra-node links (nccl-tests bus bandwidth / link)"
    )
    network_efficiency: Fraction = Field(
        default=1.0, description="NCCL's achieved share of a node's NICs across nodes (nccl-tests bus bandwidth / NICs)"
    )
    all_to_all_efficiency: Fraction | None = Field(
        default=None,
        description="NCCL all-to-all's achieved share of the intra-node links at large messages (nccl-tests "
                    "alltoall busbw / link), from a published all-to-all figure; None: collective_efficiency",
    )
    all_to_all_network_efficiency: Fraction | None = Field(
        default=None,
        description="NCCL all-to-all's achieved share of each GPU's NIC across nodes at large messages, from a "
                    "published all-to-all figure; None: network_efficiency",
    )
    collective_ramps: tuple[CollectiveRamp, ...] = Field(
        default=(), description="published nccl-tests bus bandwidth by message size, inside a node (nodes: 1) and "
                                "across nodes: the share of the large-message rate each size reaches",
    )
    compute_efficiency: dict[ComputePrecision, Fraction] = Field(
        description="achievable fraction of peak for large matmuls; one number or one per precision"
    )
    gemm_half_dim: float = Field(
        default=0.0, ge=0,
        description="GEMM shape fall-off: efficiency x prod d/(d + gemm_half_dim) over M, N, K (0: none)",
    )
    attention_kernel: AttentionKernel = Field(
        default=AttentionKernel.FLASH2, description="the kernel PyTorch's SDPA runs here by default"
    )
    attention_kernels: tuple[AttentionKernel, ...] = Field(
        default=(AttentionKernel.FLASH2, AttentionKernel.CUDNN, AttentionKernel.FLASH_TRITON, AttentionKernel.MATH),
        description="the attention kernels that run on this device (FlashAttention-3 needs Hopper; ROCm has no cuDNN)",
    )
    attention_curves: tuple[AttentionCurve, ...] = Field(
        default=(), description="published attention TFLOP/s by kernel, direction, causality, head dim, seq_len"
    )
    memory_efficiency: Fraction = Field(description="achievable fraction of HBM bandwidth for streaming ops")
    memory_efficiency_by_class: dict[MemoryClass, Fraction] = Field(
        default_factory=dict,
        description="achieved share of HBM bandwidth of eager PyTorch kernels per class (norms, elementwise); a "
                    "class not listed runs at memory_efficiency",
    )
    step_efficiency: Fraction = Field(
        default=1.0,
        description="share of the kernel-level roofline a training step reaches (kernel gaps, dispatch): set by "
                    "the software stack's residual for this device (hardware.stack.on_stack), never by a profile "
                    "file; 1.0 where the stack has none",
    )
    applied_stack: str | None = Field(
        default=None, description="the software stack these figures are laid over (hardware.stack.on_stack); "
                                  "None in every profile file")
    overlap_compute_slowdown: float = Field(
        default=0.0, ge=0, le=1,
        description="how much slower compute runs while collectives overlap it (shared SMs and memory bandwidth)",
    )
    kernel_launch_s: float = Field(ge=0, description="per-kernel launch and dispatch overhead")
    runtime_reserve_bytes: int = Field(ge=0, description="CUDA context, cuBLAS/NCCL workspaces: memory a job cannot use")
    fragmentation_factor: float = Field(ge=1.0, le=2.0, description="reserved / allocated allowance of the caching allocator")
    alloc_granularity_bytes: int = Field(default=512, gt=0, description="allocator rounding of each tensor")
    figure_sources: dict[Figure, str] = Field(
        default_factory=dict,
        description="where each figure the time model uses was measured (benchmark, repository@commit or URL), "
                    "or that it was not: the report's \"where the time figures come from\" table prints these",
    )
    time_validation: str = Field(
        default="", description="how this profile's step times compare with measured runs (docs/validation.md)"
    )
    sources: tuple[Source, ...] = Field(min_length=1)

    @field_validator("hbm_bytes", "runtime_reserve_bytes", mode="before")
    @classmethod
    def _parse_byte_sizes(cls, value: Any, info: ValidationInfo) -> Any:
        if value == 0:
            return 0
        try:
            return parse_bytes(value, str(info.field_name))
        except ConfigError as error:  # pydantic names the field itself
            raise ValueError(str(error).removeprefix(f"{info.field_name}: ")) from None

    @model_validator(mode="before")
    @classmethod
    def _broadcast_efficiency(cls, data: Any) -> Any:
        """``compute_efficiency: 0.75`` means the same fraction for every precision in the peak table."""
        if isinstance(data, dict):
            value = data.get("compute_efficiency")
            peaks = data.get("peak_flops_per_s")
            if isinstance(value, int | float) and not isinstance(value, bool) and isinstance(peaks, dict):
                return {**data, "compute_efficiency": {key: value for key in peaks}}
        return data

    @model_validator(mode="after")
    def _efficiency_covers_peaks(self) -> HardwareProfile:
        missing = [p.value for p in self.peak_flops_per_s if p not in self.compute_efficiency]
        if missing:
            raise ValueError(f"compute_efficiency has no entry for {', '.join(missing)}")
        if self.attention_kernel not in self.attention_kernels:
            raise ValueError(f"attention_kernel: {self.attention_kernel.value} is not among the attention_kernels that "
                             f"run here ({', '.join(k.value for k in self.attention_kernels)})")
        return self

    @property
    def precisions(self) -> tuple[ComputePrecision, ...]:
        return tuple(self.peak_flops_per_s)

    def supports(self, precision: ComputePrecision) -> bool:
        return precision in self.peak_flops_per_s

    def achievable_flops_per_s(self, precision: ComputePrecision) -> float:
        return self.peak_flops_per_s[precision] * self.compute_efficiency[precision]

    def achievable_bandwidth_bytes_per_s(self, kind: MemoryClass = MemoryClass.STREAM) -> float:
        return self.hbm_bandwidth_bytes_per_s * self.memory_efficiency_by_class.get(kind, self.memory_efficiency)

    def accelerator_intensity(self, precision: ComputePrecision) -> float:
        """Peak FLOP per byte of HBM traffic (lecture: H100 bf16 ~ 295)."""
        return self.peak_flops_per_s[precision] / self.hbm_bandwidth_bytes_per_s

    def with_gpus_per_node(self, gpus_per_node: int | None) -> HardwareProfile:
        """This device in nodes of ``gpus_per_node`` (None: as the profile says)."""
        if gpus_per_node is None or gpus_per_node == self.gpus_per_node:
            return self
        if gpus_per_node <= 0:
            raise ValueError(f"gpus_per_node: must be positive, got {gpus_per_node}")
        return self.model_copy(update={"gpus_per_node": gpus_per_node})

    def is_marketed_size(self, cap_bytes: int) -> bool:
        """``cap_bytes`` is the size the device is sold as, in GB or GiB (80GiB on an "80GB" H100,
        whose driver reports 79.6 GiB): people write that cap for the whole card."""
        if self.marketed_hbm_gb is None:
            return False
        return any(cap_bytes == round(self.marketed_hbm_gb * unit) for unit in (10**9, 2**30))

    def usable_cap_bytes(self, cap_bytes: int) -> int | None:
        """The cap a plan may use for a requested ``cap_bytes``: itself when the device has that
        much, the whole device when it is the device's marketed size, else None (more than it has)."""
        if cap_bytes <= self.hbm_bytes:
            return cap_bytes
        return self.hbm_bytes if self.is_marketed_size(cap_bytes) else None

    def round_alloc(self, n_bytes: int) -> int:
        """Bytes the caching allocator hands out for a request of ``n_bytes``."""
        if n_bytes <= 0:
            return 0
        g = self.alloc_granularity_bytes
        return -(-n_bytes // g) * g
