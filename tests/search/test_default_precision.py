"""The default search trains like the fp32 baseline: policies that change numerics (bf16-true,
fp8-mixed) are searched only when ``--precision`` names them, and a plan using one says what it trades."""

from __future__ import annotations

import pytest

from hardware.dtypes import ComputePrecision
from hardware.profile import HardwareProfile
from hardware.registry import load_hardware
from planner.model.config import ModelConfig, TrainConfig
from planner.precision import PrecisionPolicy, precision_spec
from roofplan import api
from search.space import build_space

TINY = ModelConfig(family="llama", n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=256, max_seq_len=128)
TRAINING = TrainConfig(seq_len=64, global_batch_size=8)


@pytest.mark.parametrize(("hardware", "expected"), [
    ("h100-sxm", (PrecisionPolicy.BF16_MIXED,)),  # bf16 tensor cores: bf16-mixed only
    ("a100-sxm-80gb", (PrecisionPolicy.BF16_MIXED,)),
])
def test_default_space_has_only_numerics_preserving_policies(hardware: str, expected: tuple[PrecisionPolicy, ...]) -> None:
    space = build_space(TINY, TRAINING, load_hardware(hardware))
    assert space.precisions == expected
    assert not any(precision_spec(p).changes_numerics for p in space.precisions)


def _without(name: str, *dropped: ComputePrecision) -> HardwareProfile:
    """A bundled profile whose device lacks ``dropped`` matmul precisions (every bundled GPU has
    bf16; a V100 or T4 has fp16 tensor cores only)."""
    hw = load_hardware(name)
    data = hw.model_dump()
    for key in ("peak_flops_per_s", "compute_efficiency"):
        data[key] = {p: v for p, v in data[key].items() if p not in dropped}
    return HardwareProfile.model_validate({**data, "name": f"{name}-without-{'-'.join(p.value for p in dropped)}"})


def test_every_bundled_device_searches_one_numerics_preserving_policy() -> None:
    for name in ("h100-sxm", "a100-sxm-40gb", "l4", "rtx-4090", "mi300x", "cpu"):
        space = build_space(TINY, TRAINING, load_hardware(name))
        assert len(space.precisions) == 1
        assert not precision_spec(space.precisions[0]).changes_numerics


def test_devices_without_bf16_fall_back_to_fp16_mixed() -> None:
    no_bf16 = _without("a100-sxm-80gb", ComputePrecision.BF16)
    assert not no_bf16.supports(ComputePrecision.BF16)
    assert build_space(TINY, TRAINING, no_bf16).precisions == (PrecisionPolicy.FP16_MIXED,)
    result = api.plan(TINY, TRAINING, no_bf16)
    assert result.best.knobs.precision is PrecisionPolicy.FP16_MIXED
    # and without fp16 tensor cores either: fp32, the baseline itself
    neither = _without("a100-sxm-80gb", ComputePrecision.BF16, ComputePrecision.FP16, ComputePrecision.FP8)
    assert build_space(TINY, TRAINING, neither).precisions == (PrecisionPolicy.FP32,)


def test_numerics_changing_policies_only_when_named() -> None:
    hw = load_hardware("h100-sxm")
    space = build_space(TINY, TRAINING, hw, precisions=(PrecisionPolicy.BF16_MIXED, PrecisionPolicy.BF16_TRUE))
    assert space.precisions == (PrecisionPolicy.BF16_MIXED, PrecisionPolicy.BF16_TRUE)
    result = api.plan(TINY, TRAINING, "h100-sxm", precisions=["bf16-true", "bf16-mixed"])
    assert result.best.knobs.precision is PrecisionPolicy.BF16_TRUE  # faster, when asked for
    default = api.plan(TINY, TRAINING, "h100-sxm")
    assert default.best.knobs.precision is PrecisionPolicy.BF16_MIXED
    assert all(e.knobs.precision is PrecisionPolicy.BF16_MIXED for e in default.alternatives)


def test_every_policy_states_whether_it_changes_numerics() -> None:
    changing = {p for p in PrecisionPolicy if precision_spec(p).changes_numerics}
    assert changing == {PrecisionPolicy.BF16_TRUE, PrecisionPolicy.FP8_MIXED}
    for policy in changing:
        assert len(precision_spec(policy).trades or "") > 40  # a sentence, not a flag
