"""Element types: what a tensor is stored in, and what a matmul runs at.

Storage bytes per element follow IEEE/OCP definitions (lecture: fp32 = 1+8+23 bits = 4 B,
bf16 = 1+8+7 = 2 B, fp16 = 1+5+10 = 2 B, fp8 = 1 B).
"""

from __future__ import annotations

from enum import StrEnum


class DType(StrEnum):
    """Storage dtype of a tensor."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT64 = "int64"
    BOOL = "bool"

    @property
    def n_bytes(self) -> int:
        return _STORAGE_BYTES[self]


_STORAGE_BYTES = {
    DType.FP32: 4,
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP8: 1,
    DType.INT64: 8,
    DType.BOOL: 1,
}


class ComputePrecision(StrEnum):
    """The precision a matmul runs at: the key of a profile's dense peak FLOP/s table."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP4 = "fp4"
