"""Properties of the roofline op time (Williams et al. 2009): time = max(compute, memory) + launch."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hardware.dtypes import ComputePrecision
from hardware.profile import HardwareProfile
from hardware.registry import bundled_names, load_hardware
from hardware.roofline import Bound, op_time


@st.composite
def profile_and_precision(draw: st.DrawFn) -> tuple[HardwareProfile, ComputePrecision]:
    hw = load_hardware(draw(st.sampled_from(bundled_names())))
    return hw, draw(st.sampled_from(hw.precisions))


flops_st = st.one_of(st.just(0.0), st.floats(min_value=1.0, max_value=1e18, allow_nan=False, allow_infinity=False))
bytes_st = st.one_of(st.just(0.0), st.floats(min_value=1.0, max_value=1e15, allow_nan=False, allow_infinity=False))
kernels_st = st.integers(min_value=0, max_value=16)


@settings(max_examples=200, deadline=None)
@given(hp=profile_and_precision(), flops=flops_st, n_bytes=bytes_st, kernels=kernels_st)
def test_time_covers_both_bounds(
    hp: tuple[HardwareProfile, ComputePrecision], flops: float, n_bytes: float, kernels: int
) -> None:
    hw, precision = hp
    t = op_time(flops, n_bytes, precision, hw, n_kernels=kernels)
    assert t.time_s >= t.compute_time_s
    assert t.time_s >= t.memory_time_s
    assert t.time_s >= t.lower_bound_s
    assert t.time_s == pytest.approx(max(t.compute_time_s, t.memory_time_s) + kernels * hw.kernel_launch_s, rel=1e-12)
    # the achievable times use the efficiencies, so they are never faster than the ideal ones
    assert t.compute_time_s >= flops / hw.peak_flops_per_s[precision] * (1 - 1e-12)
    assert t.memory_time_s >= n_bytes / hw.hbm_bandwidth_bytes_per_s * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(hp=profile_and_precision(), flops=flops_st, n_bytes=bytes_st)
def test_lower_bound_is_the_pure_roofline(
    hp: tuple[HardwareProfile, ComputePrecision], flops: float, n_bytes: float
) -> None:
    hw, precision = hp
    t = op_time(flops, n_bytes, precision, hw)
    expected = max(flops / hw.peak_flops_per_s[precision], n_bytes / hw.hbm_bandwidth_bytes_per_s)
    assert t.lower_bound_s == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert t.compute_time_s == pytest.approx(
        flops / (hw.peak_flops_per_s[precision] * hw.compute_efficiency[precision]), rel=1e-12, abs=0.0
    )
    assert t.memory_time_s == pytest.approx(
        n_bytes / (hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency), rel=1e-12, abs=0.0
    )
    assert t.flops == flops and t.bytes_moved == n_bytes


@settings(max_examples=200, deadline=None)
@given(hp=profile_and_precision(), flops=flops_st, n_bytes=bytes_st)
def test_bound_classification_is_consistent(
    hp: tuple[HardwareProfile, ComputePrecision], flops: float, n_bytes: float
) -> None:
    hw, precision = hp
    assume(flops > 0 or n_bytes > 0)
    t = op_time(flops, n_bytes, precision, hw)
    if t.compute_time_s > t.memory_time_s:
        assert t.bound is Bound.COMPUTE
    elif t.compute_time_s < t.memory_time_s:
        assert t.bound is Bound.MEMORY
    if flops > 0 and n_bytes > 0:
        assert t.intensity_flops_per_byte == pytest.approx(flops / n_bytes)
        # the achievable ridge point: ops above it are compute-bound, below it memory-bound
        ridge = hw.achievable_flops_per_s(precision) / hw.achievable_bandwidth_bytes_per_s()
        if t.intensity_flops_per_byte > ridge * (1 + 1e-9):
            assert t.bound is Bound.COMPUTE
        elif t.intensity_flops_per_byte < ridge * (1 - 1e-9):
            assert t.bound is Bound.MEMORY


@settings(max_examples=100, deadline=None)
@given(
    hp=profile_and_precision(),
    n_bytes=st.floats(min_value=1.0, max_value=1e15, allow_nan=False, allow_infinity=False),
)
def test_zero_flops_is_memory_bound(hp: tuple[HardwareProfile, ComputePrecision], n_bytes: float) -> None:
    hw, precision = hp
    t = op_time(0.0, n_bytes, precision, hw)
    assert t.bound is Bound.MEMORY
    assert t.compute_time_s == 0.0
    assert t.intensity_flops_per_byte == 0.0


@settings(max_examples=100, deadline=None)
@given(
    hp=profile_and_precision(),
    flops=st.floats(min_value=1.0, max_value=1e18, allow_nan=False, allow_infinity=False),
)
def test_zero_bytes_is_compute_bound(hp: tuple[HardwareProfile, ComputePrecision], flops: float) -> None:
    hw, precision = hp
    t = op_time(flops, 0.0, precision, hw)
    assert t.bound is Bound.COMPUTE
    assert t.memory_time_s == 0.0
    assert math.isinf(t.intensity_flops_per_byte)


@settings(max_examples=100, deadline=None)
@given(hp=profile_and_precision(), flops=flops_st, n_bytes=bytes_st, scale=st.floats(min_value=1.0, max_value=1e3))
def test_more_work_never_takes_less_time(
    hp: tuple[HardwareProfile, ComputePrecision], flops: float, n_bytes: float, scale: float
) -> None:
    hw, precision = hp
    base = op_time(flops, n_bytes, precision, hw)
    assert op_time(flops * scale, n_bytes, precision, hw).time_s >= base.time_s
    assert op_time(flops, n_bytes * scale, precision, hw).time_s >= base.time_s
    assert op_time(flops * scale, n_bytes * scale, precision, hw).lower_bound_s >= base.lower_bound_s


def test_golden_h100_matmul() -> None:
    # A square bf16 matmul of 8192^3 on H100 SXM: 2*8192^3 FLOPs over (3 * 8192^2 * 2) bytes,
    # intensity ~2731 FLOP/B >> ridge ~295 (docs/references.md "Hardware peaks"), so compute-bound; its pure-roofline
    # time is 2*8192^3 / 989.4e12 = 1.111 ms. Tolerance 0.1%.
    hw = load_hardware("h100-sxm")
    n = 8192
    t = op_time(2.0 * n**3, 3.0 * n * n * 2, ComputePrecision.BF16, hw)
    assert t.bound is Bound.COMPUTE
    assert t.lower_bound_s == pytest.approx(1.111e-3, rel=1e-3)
    assert t.intensity_flops_per_byte == pytest.approx(2730.7, rel=1e-3)
