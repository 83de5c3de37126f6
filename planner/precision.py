"""Precision policies (Lightning-style names) and the bytes each keeps per parameter.

The table states what PyTorch really allocates for each policy, because ``validate`` runs the
same policy in PyTorch and compares:

| policy       | params | grads | master | AdamW m+v | matmul | how it runs in PyTorch                      |
|--------------|--------|-------|--------|-----------|--------|---------------------------------------------|
| fp32         | 4      | 4     | 0      | 8         | fp32   | plain fp32                                  |
| tf32         | 4      | 4     | 0      | 8         | tf32   | fp32 storage, TF32 tensor-core matmuls      |
| bf16-mixed   | 4      | 4     | 0      | 8         | bf16   | fp32 params (they are the master), autocast |
| fp16-mixed   | 4      | 4     | 0      | 8         | fp16   | as bf16-mixed plus a GradScaler             |
| bf16-true    | 2      | 2     | 0      | 4         | bf16   | bf16 params; torch AdamW keeps m, v in the param dtype |
| fp8-mixed    | 4      | 4     | 0      | 8         | fp8    | bf16-mixed memory with fp8 matmuls (Float8Linear)     |

Under autocast the fp32 parameters are the master copy; the low-precision weight copies that
autocast caches for the forward are activations-like (they live until each op's backward) and
are priced in the linear formula, not here. ZeRO's 16 bytes/param (Rajbhandari et al. 2019,
2 + 2 + 12) and the mixed rows here both total 16; the lecture's bf16-true 2 + 2 + 4 + 4 = 12
assumes fp32 moments, which ``torch.optim.AdamW`` cannot keep for bf16 parameters (it raises
for fp32 state on bf16 params), so bf16-true totals 8 bytes/param with torch's AdamW.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from hardware.dtypes import ComputePrecision, DType


class PrecisionPolicy(StrEnum):
    FP32 = "fp32"
    TF32 = "tf32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    BF16_TRUE = "bf16-true"
    FP8_MIXED = "fp8-mixed"


class PrecisionSpec(BaseModel):
    """How one policy stores and computes."""

    model_config = ConfigDict(frozen=True)

    policy: PrecisionPolicy
    param_dtype: DType
    grad_dtype: DType
    master_dtype: DType | None
    matmul_precision: ComputePrecision
    autocast_dtype: DType | None  # low-precision dtype autocast casts matmul inputs to; None = no autocast
    loss_scaling: bool
    trades: str | None = None  # what the policy gives up against fp32 training; None: trains like fp32

    @property
    def changes_numerics(self) -> bool:
        """Whether training under this policy departs from the fp32 baseline's updates (searched
        only when named with ``--precision``; the report says what it trades)."""
        return self.trades is not None

    @property
    def activation_dtype(self) -> DType:
        """dtype of matmul outputs."""
        return self.autocast_dtype or self.param_dtype

    @property
    def param_bytes(self) -> int:
        return self.param_dtype.n_bytes

    @property
    def grad_bytes(self) -> int:
        return self.grad_dtype.n_bytes

    @property
    def master_bytes(self) -> int:
        return self.master_dtype.n_bytes if self.master_dtype else 0


_FP32 = DType.FP32
PRECISION_SPECS: dict[PrecisionPolicy, PrecisionSpec] = {
    spec.policy: spec
    for spec in (
        PrecisionSpec(policy=PrecisionPolicy.FP32, param_dtype=_FP32, grad_dtype=_FP32, master_dtype=None,
                      matmul_precision=ComputePrecision.FP32, autocast_dtype=None, loss_scaling=False),
        PrecisionSpec(policy=PrecisionPolicy.TF32, param_dtype=_FP32, grad_dtype=_FP32, master_dtype=None,
                      matmul_precision=ComputePrecision.TF32, autocast_dtype=None, loss_scaling=False),
        PrecisionSpec(policy=PrecisionPolicy.BF16_MIXED, param_dtype=_FP32, grad_dtype=_FP32, master_dtype=None,
                      matmul_precision=ComputePrecision.BF16, autocast_dtype=DType.BF16, loss_scaling=False),
        PrecisionSpec(policy=PrecisionPolicy.FP16_MIXED, param_dtype=_FP32, grad_dtype=_FP32, master_dtype=None,
                      matmul_precision=ComputePrecision.FP16, autocast_dtype=DType.FP16, loss_scaling=True),
        PrecisionSpec(policy=PrecisionPolicy.BF16_TRUE, param_dtype=DType.BF16, grad_dtype=DType.BF16,
                      master_dtype=None, matmul_precision=ComputePrecision.BF16, autocast_dtype=None,
                      loss_scaling=False,
                      trades="bf16 weights and AdamW moments, no fp32 master copy: an update smaller than bf16's "
                             "resolution (8 bits of mantissa, about 1/256 of the weight) is lost"),
        PrecisionSpec(policy=PrecisionPolicy.FP8_MIXED, param_dtype=_FP32, grad_dtype=_FP32, master_dtype=None,
                      matmul_precision=ComputePrecision.FP8, autocast_dtype=DType.BF16, loss_scaling=False,
                      trades="fp8 matmul inputs (E4M3, 3 bits of mantissa, per-tensor scales): lower-precision "
                             "products than bf16, which can change the loss curve"),
    )
}


def precision_spec(policy: PrecisionPolicy | str) -> PrecisionSpec:
    return PRECISION_SPECS[PrecisionPolicy(policy)]
