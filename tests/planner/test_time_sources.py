"""The report's "Where the time figures come from" table (roofplan/time_sources.py): every line
names the specific source of the figure it prints, read from the profile's YAML data."""

from __future__ import annotations

import pytest

from hardware.dtypes import ComputePrecision
from hardware.profile import Figure, Source
from hardware.registry import bundled_names, load_hardware
from roofplan import api
from roofplan.time_sources import NO_SOURCE, time_sources

MODEL, TRAINING = api.load_model("llama2-7b", seq_len=4096, global_batch_size=64)


def _rows(profile: str, gpus: int, precision: ComputePrecision = ComputePrecision.BF16) -> dict[str, str]:
    hw = load_hardware(profile)
    if not hw.supports(precision):
        precision = hw.precisions[0]
    return dict(time_sources(MODEL, 4096, hw, precision, gpus))


@pytest.mark.parametrize("profile", bundled_names())
@pytest.mark.parametrize("gpus", [1, 8, 64])
def test_every_line_names_its_source(profile: str, gpus: int) -> None:
    rows = _rows(profile, gpus)
    for what, figure in rows.items():
        assert NO_SOURCE not in figure, (profile, what)
        assert "profile sources" not in figure, (profile, what)  # the old generic pointer
        assert "(" in figure or "no published" in figure, (profile, what)


def test_h100_lines_name_their_benchmarks() -> None:
    rows = _rows("h100-sxm", 64)
    assert "MAMF table" in rows["GEMMs"] and "matmul_interpolator_data.h" in rows["GEMMs"]
    assert "BabelStream" in rows["memory-bound ops"]
    assert "Liger-Kernel" in rows["memory-bound: norms"]
    assert "llm-foundry" in rows["in a real step"]
    assert "arXiv 2507.03114" in rows["overlap"]
    assert "GTC24 S62129" in rows["collectives"]
    # the nccl-tests curves the collectives of this plan use: across nodes the all-reduce lines, the
    # one-node ring curve for all-gather and reduce-scatter
    assert "arXiv 2411.13055" in rows["all-reduce by size"] and "4, 16, 64, 512 nodes" in rows["all-reduce by size"]
    assert "together-nccl-tests" in rows["all-gather, reduce-scatter by size"]
    inside = _rows("h100-sxm", 8)
    assert "together-nccl-tests" in inside["collectives by size"] and "all-reduce by size" not in inside
    assert "collectives" not in _rows("h100-sxm", 1)


def test_the_sources_are_the_profiles_yaml_data() -> None:
    """time_sources reads the profile's figure_sources, so a profile's text is what the report prints."""
    hw = load_hardware("a100-sxm-80gb")
    assert hw.figure_sources[Figure.MEMORY_ELEMENTWISE] in _rows("a100-sxm-80gb", 8)["memory-bound: elementwise"]
    edited = hw.model_copy(update={"figure_sources": {**hw.figure_sources, Figure.OVERLAP_COMPUTE_SLOWDOWN: "a paper"}})
    rows = dict(time_sources(MODEL, 4096, edited, ComputePrecision.BF16,
                             16))
    assert rows["overlap"].endswith("(a paper)")
    bare = hw.model_copy(update={"figure_sources": {}})
    rows = dict(time_sources(MODEL, 4096, bare, ComputePrecision.BF16,
                             16))
    assert NO_SOURCE in rows["GEMMs"]  # a user profile without sources says so


def test_a_calibrated_profile_names_its_measurement_for_what_calibration_replaced() -> None:
    hw = load_hardware("h100-sxm")
    measured = Source(fields="every figure: measured by `hardware calibrate` on node1", url="measured:hardware-calibrate")
    calibrated = hw.model_copy(update={"sources": (*hw.sources, measured)})
    rows = dict(time_sources(MODEL, 4096, calibrated,
                             ComputePrecision.BF16, 64))
    assert "measured by `hardware calibrate`" in rows["GEMMs"] and "MAMF" not in rows["GEMMs"]
    assert "measured by `hardware calibrate`" in rows["memory-bound ops"]
    assert "arXiv 2507.03114" in rows["overlap"]  # not a figure calibration measures


def test_attention_names_the_curve_of_each_direction() -> None:
    """H100: FlashAttention-2's forward has its own published figure (FA3 paper Fig. 5), the
    causal backward only the README's forward+backward one; A100: one forward+backward curve."""
    rows = _rows("h100-sxm", 1)
    assert "arXiv 2407.08608" in rows["attention forward"] and "(fwd;" in rows["attention forward"]
    assert "flash2_h100_fwd_bwd_benchmark.png" in rows["attention backward"]
    a100 = _rows("a100-sxm-80gb", 1)
    assert "attention forward" not in a100 and "flash2_a100_fwd_bwd_benchmark.png" in a100["attention"]


def test_expert_parallel_plans_name_the_all_to_all_model() -> None:
    """An ep > 1 plan gets an all-to-all row naming the published curve or the links' model and the
    share's source; a plan without expert parallelism gets none."""
    h100, b200 = load_hardware("h100-sxm"), load_hardware("b200")
    assert "all-to-all (expert parallelism)" not in dict(time_sources(MODEL, 4096, h100, ComputePrecision.BF16, 8))
    inside = dict(time_sources(MODEL, 4096, h100, ComputePrecision.BF16, 8, ep=8))["all-to-all (expert parallelism)"]
    assert inside.startswith("published all-to-all the one-node curve") and "collective_interpolator_data.h" in inside
    across = dict(time_sources(MODEL, 4096, h100, ComputePrecision.BF16, 32, ep=32))["all-to-all (expert parallelism)"]
    assert "2, 8, 32 nodes" in across and h100.figure_sources[Figure.ALL_TO_ALL_NETWORK_EFFICIENCY] in across
    fallback = dict(time_sources(MODEL, 4096, b200, ComputePrecision.BF16, 16, ep=16))["all-to-all (expert parallelism)"]
    assert fallback.startswith("links' model") and "network_efficiency" in fallback
