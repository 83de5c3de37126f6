"""Collectives as NCCL runs them, checked against published nccl-tests bus bandwidths
(docs/kernel_benchmarks.md section 4, which says which figures build the profiles and which only
check them). Bus bandwidths in GB/s, nccl-tests' out-of-place column; sizes as nccl-tests prints
them (the full tensor; for an all-gather the gathered array)."""

from __future__ import annotations

import pytest

from hardware.collectives import (
    Algorithm,
    Collective,
    bus_bandwidth_measured,
    collective_time_s,
    ring_steps,
    ring_time_s,
    tree_time_s,
)
from hardware.ramps import CollectiveRamp
from hardware.registry import load_hardware

MIB, GIB = 2**20, 2**30
AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
H100 = load_hardware("h100-sxm")


def _busbw(hw, size: float, kind: Collective, gpus: int) -> float:  # noqa: ANN001
    return bus_bandwidth_measured(size, kind, hw, gpus, 8) / 1e9


# nccl-tests all_reduce bus bandwidth for large messages (GTC24 S62129 slide 12; the NCCL
# maintainers quote ~370 GB/s on H100 NVLink without SHARP). Tolerance 5%: the profiles' efficiencies
# are these figures over the link rates (fit), so this checks the model's algebra end to end.
@pytest.mark.parametrize(("profile", "gpus", "published_gb_s"), [
    ("a100-sxm-80gb", 8, 232),   # one DGX A100, NVLink 3
    ("h100-sxm", 8, 370),        # one DGX H100, NVLink 4, ring (no NVLS)
    ("a100-sxm-80gb", 16, 192),  # DGX A100 across nodes, 8 x 200 Gb/s HDR
    ("h100-sxm", 16, 380),       # DGX H100 across nodes, 8 x 400 Gb/s NDR
])
def test_all_reduce_bus_bandwidth_matches_nccl_tests(profile: str, gpus: int, published_gb_s: float) -> None:
    assert _busbw(load_hardware(profile), 8 * GIB, AR, gpus) == pytest.approx(published_gb_s, rel=0.05)


# One H100 node, NCCL 2.26.2, all_gather_perf / reduce_scatter_perf -g 8 (togethercomputer/
# together-nccl-tests benchmarks/H100/results/20260305_220043/{all_gather,reduce_scatter}_ring.out
# @6698e53c). The profile's curve is the same run's ring all_reduce (fit): these two collectives only
# check it, and with it the x axis of every curve, the bytes a rank sends (an all-reduce at S sends
# what an all-gather sends at 2S). Tolerance 15%: the largest gap is 12% (8-16 MiB, where the three
# collectives' protocol switches differ); the two runs of this node in the repository differ by up to
# 5% at one size. 64 and 256 KiB are latency-bound: the model's floor is the curve's own (38 us).
NODE_SIZES = (64 * 2**10, 256 * 2**10,
              *(s * MIB for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)))
H100_ALL_GATHER = (1.61, 6.24, 22.02, 44.24, 88.77, 156.12, 207.36, 234.03, 278.45, 298.43, 320.49, 335.70, 344.53,
                   350.36, 355.23, 357.90)
H100_REDUCE_SCATTER = (1.65, 6.27, 22.60, 44.05, 88.02, 145.53, 203.96, 247.18, 284.43, 307.89, 327.04, 337.19, 346.49,
                       351.01, 359.62, 363.18)


@pytest.mark.parametrize(("kind", "size", "published"), [
    *((AG, s, v) for s, v in zip(NODE_SIZES, H100_ALL_GATHER, strict=True)),
    *((RS, s, v) for s, v in zip(NODE_SIZES, H100_REDUCE_SCATTER, strict=True)),
])
def test_all_gather_and_reduce_scatter_by_size_in_an_h100_node(kind: Collective, size: int, published: float) -> None:
    assert _busbw(H100, size, kind, 8) == pytest.approx(published, rel=0.15)


# H200 node, 16 GiB, NCCL 2.27.7 (stas00/ml-engineering network/README.md; docs 4.1 [S16]): ring
# paths. The H200 profile borrows the H100's curve; within 5%.
@pytest.mark.parametrize(("kind", "published"), [(AG, 361.4), (RS, 362.9), (AR, 367.2)])
def test_large_rings_in_an_h200_node(kind: Collective, published: float) -> None:
    assert _busbw(load_hardware("h200"), 16 * GIB, kind, 8) == pytest.approx(published, rel=0.05)


# A second, independent A100 node (stas00/ml-engineering network/README.md, "Real network throughput",
# all_reduce_perf -g 8; docs 4.1 [S15]) against the profile, whose curve is Azure's ND A100 v4 (fit):
# within 12% from 4 MiB to 8 GiB. 1 MiB is left out: there the two systems differ 2x (36.2 vs 18.0).
@pytest.mark.parametrize(("mib", "published"), [(4, 72.3), (16, 106.2), (64, 171.5), (256, 194.1), (1024, 229.0),
                                                (8192, 234.6)])
def test_all_reduce_by_message_size_on_another_a100_node(mib: int, published: float) -> None:
    assert _busbw(load_hardware("a100-sxm-80gb"), mib * MIB, AR, 8) == pytest.approx(published, rel=0.12)


# H100 all_reduce across nodes, Fernandez et al. (arXiv 2411.13055) scaling figure, read off (+-10 GB/s;
# docs 4.2 [S24]): the profile holds its 4, 16, 64 and 512-node lines (fit); its 8 and 32-node lines
# check the interpolation in log(nodes). Tolerance 10%: the reading error is 3-20% at 16 MiB (44-89
# GB/s +-10) and ~3% above; the largest gap is 5%.
@pytest.mark.parametrize(("nodes", "mib", "published"), [
    (8, 16, 89), (8, 64, 190), (8, 256, 280), (8, 1024, 329), (8, 8192, 356),
    (32, 16, 58), (32, 64, 151), (32, 256, 255), (32, 1024, 314), (32, 16384, 353),
])
def test_all_reduce_at_8_and_32_h100_nodes(nodes: int, mib: int, published: float) -> None:
    assert _busbw(H100, mib * MIB, AR, 8 * nodes) == pytest.approx(published, rel=0.10)


# H100 at 32 and 8192 GPUs (GTC24 S62129 slide 35, NVLSTree; read off, +-10 GB/s; docs 4.2 [S23]), a
# different scan than the profile's lines: within 10% (largest gap 8.5%).
@pytest.mark.parametrize(("mib", "gpus", "published"), [
    (64, 32, 230), (256, 32, 313), (1024, 32, 350), (64, 8192, 108), (256, 8192, 225), (1024, 8192, 308),
])
def test_all_reduce_across_nodes_by_size_and_scale(mib: int, gpus: int, published: float) -> None:
    assert _busbw(H100, mib * MIB, AR, gpus) == pytest.approx(published, rel=0.10)


# AWS p5.48xlarge (8 x H100, 32 x 100 Gb/s EFA: the profile's 400 GB/s per node), NCCL over
# aws-ofi-nccl, all_reduce_perf (crazyguitar/aws-gpu-communication-benchmark data/nccl_all_reduce.csv
# @fd167f97). At 8 GiB the bytes dominate, so a different network's latency matters little: within
# 15% (the 32-node curve is still rising at 8 GiB, 302.8 -> 321.1 GB/s from 4 GiB). Mid sizes on EFA
# run 30-100% below the profile's InfiniBand curves: docs 4.2 records them; they are not this
# profile's network.
@pytest.mark.parametrize(("nodes", "published"), [(8, 355.36), (16, 356.27), (32, 321.10)])
def test_large_all_reduce_on_8_to_32_aws_p5_nodes(nodes: int, published: float) -> None:
    assert _busbw(H100, 8 * GIB, AR, 8 * nodes) == pytest.approx(published, rel=0.15)


# The same AWS cluster, all_gather_perf on 2-32 nodes, 32 MiB-2 GiB (data/nccl_all_gather.csv
# @fd167f97). A ring all-gather across nodes is the one-node curve plus NCCL's latency for every
# extra ring step; EFA's network step is slower than InfiniBand's 14 us (the profile's), so one
# number is fitted here, the network step latency, on one point (32 nodes, 32 MiB: latency-bound;
# 59 us), and the other points check the structure: within 15% (largest gaps -13%, +14%). Left out,
# with the reason: the four points where the per-rank slice is 16 MiB (256 MiB on 2 nodes, 512 MiB
# on 4, 1 GiB on 8, 2 GiB on 16) measure less than, or the same as, half the size did (215.6 < 234.5,
# 220.6 < 253.4, 224.5 < 261.3, 265.2 ~ 261.9): an algorithm or protocol switch of the run's tuner
# that no size-monotone model follows. The point after the first dip (2 nodes, 512 MiB) has not
# recovered: +20%, checked at 25% so that it stays on record.
AWS_ALL_GATHER = {
    2: (131.30, 200.43, 234.54, None, 275.52, 322.00, 328.58),
    4: (83.56, 138.94, 211.73, 253.36, None, 288.53, 330.92),
    8: (46.29, 86.80, 143.66, 215.43, 261.26, None, 293.71),
    16: (24.90, 46.99, 87.68, 144.05, 219.97, 261.88, None),
    32: (12.38, 24.96, 45.65, 86.30, 146.38, 222.40, 262.77),
}
AWS_SIZES_MIB = (32, 64, 128, 256, 512, 1024, 2048)


def _efa_profile():  # noqa: ANN202
    """The H100 profile with its network step latency fitted to the 32-node, 32 MiB point."""
    low, high = 1e-6, 1e-3
    for _ in range(60):
        mid = (low + high) / 2
        hw = H100.model_copy(update={"inter_node_hop_latency_s": mid})
        low, high = (mid, high) if _busbw(hw, 32 * MIB, AG, 256) > AWS_ALL_GATHER[32][0] else (low, mid)
    return H100.model_copy(update={"inter_node_hop_latency_s": (low + high) / 2})


EFA = _efa_profile()


@pytest.mark.parametrize(("nodes", "mib", "published"), [
    (n, s, v) for n, row in AWS_ALL_GATHER.items() for s, v in zip(AWS_SIZES_MIB, row, strict=True)
    if v is not None and (n, s) != (32, 32)
])
def test_all_gather_across_2_to_32_aws_p5_nodes(nodes: int, mib: int, published: float) -> None:
    assert 40e-6 < EFA.inter_node_hop_latency_s < 80e-6  # ~4x InfiniBand's step: EFA, SRD through a proxy
    tolerance = 0.25 if (nodes, mib) == (2, 512) else 0.15
    assert _busbw(EFA, mib * MIB, AG, 8 * nodes) == pytest.approx(published, rel=tolerance)


# B200 rings at 1-64 nodes, 32 GiB (together-nccl-tests baselines/flapping-airplanes/
# 2026-05-12_nccl_collective_scaling_report.md @6fd65d19, NCCL 2.28.9, NDR 400 Gb/s per GPU): the
# profile's efficiencies are the 1-node and 2-node all_reduce rings (fit); the others check that
# large-message rings stay flat from 2 to 64 nodes and that all-gather runs at the all-reduce's bus
# rate: within 5%. The RS point is the same cluster's 4-node run of 2026-07-11 at 8 GiB.
@pytest.mark.parametrize(("kind", "gpus", "gib", "published"), [
    (AG, 8, 32, 676.54), (AR, 64, 32, 389.20), (AR, 512, 32, 389.81), (AG, 16, 32, 371.44), (AG, 64, 32, 380.62),
    (AG, 512, 32, 380.15), (RS, 32, 8, 384.1),
])
def test_b200_rings_from_1_to_64_nodes(kind: Collective, gpus: int, gib: int, published: float) -> None:
    assert _busbw(load_hardware("b200"), gib * GIB, kind, gpus) == pytest.approx(published, rel=0.05)


def test_one_curve_serves_every_ring_collective() -> None:
    """The x axis is the bytes a rank sends: on the H100 node an all-reduce at S and an all-gather
    at 2S send the same and, measured, reach within 15% of the same bus bandwidth from 1 MiB up
    (largest gaps 12-14%, at 1, 4 and 8 MiB; 1-6% from 16 MiB on)."""
    ar = dict(zip((1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                  (39.44, 87.26, 138.26, 182.39, 231.88, 274.45, 318.55, 334.33, 347.64, 355.65, 360.07, 363.84,
                   366.72),
                  strict=True))
    ag = dict(zip((s // MIB for s in NODE_SIZES[2:]), H100_ALL_GATHER[2:], strict=True))
    for mib, busbw in ar.items():
        assert ag[2 * mib] == pytest.approx(busbw, rel=0.15)
    ramp = CollectiveRamp(nodes=1, collective=AG, sizes_bytes=(MIB, 4 * MIB), busbw_gb_s=(10.0, 40.0), source="test")
    assert ramp.sent_bytes() == (7 / 8 * MIB, 7 / 2 * MIB)
    assert ramp.fraction(7 / 8 * MIB) == pytest.approx(0.25) and ramp.fraction(7 / 4 * MIB) == pytest.approx(0.5)
    assert ramp.fraction(7 / 16 * MIB) == pytest.approx(0.125)  # below the curve: its first point's time


def test_multi_node_rings_use_every_nic_of_a_node() -> None:
    """Regression: across nodes the ring was priced at one GPU's NIC (50 GB/s on a DGX H100),
    8x too slow; NCCL runs a channel per NIC. The bus bandwidth stays flat from 2 to 64 nodes for
    large messages (as in published scans), bounded by NVLink."""
    one_nic = H100.inter_node_bandwidth_bytes_per_s
    for gpus in (16, 64, 512):
        busbw = bus_bandwidth_measured(16 * GIB, AG, H100, gpus, 8)
        assert busbw > 6 * one_nic
        assert busbw <= H100.intra_node_bandwidth_bytes_per_s


def test_ring_steps_follow_nccl() -> None:
    assert ring_steps(AR, 16, 2) == (30, 4)
    assert ring_steps(AG, 16, 2) == (15, 1)
    assert ring_steps(RS, 8, 1) == (7, 0)


def test_latency_dominates_small_messages_and_grows_with_ranks() -> None:
    small = [ring_time_s(1e5, AG, H100, n, 8) for n in (8, 64, 512)]
    assert small == sorted(small)
    assert small[-1] > 10 * small[0]  # hundreds of ring steps of latency at 512 ranks


def test_a_growing_ring_loses_mid_size_bandwidth() -> None:
    """An all-gather's 256 MiB: full speed on one node, a third less on 32 (the extra ring steps'
    latency), and the large-message rate unchanged."""
    busbw = [_busbw(H100, 256 * MIB, AG, 8 * n) for n in (1, 4, 32)]
    assert busbw == sorted(busbw, reverse=True) and busbw[-1] < 0.7 * busbw[0]
    assert _busbw(H100, 16 * GIB, AG, 256) == pytest.approx(_busbw(H100, 16 * GIB, AG, 32), rel=0.03)


def test_all_reduce_picks_the_faster_of_ring_and_tree() -> None:
    for n_bytes in (1e5, 1e7, 1e9, 1e10):
        for gpus in (16, 128, 1024):
            seconds, algorithm = collective_time_s(n_bytes, AR, H100, gpus, 8)
            ring = ring_time_s(n_bytes, AR, H100, gpus, 8)
            tree = tree_time_s(n_bytes, H100, gpus, 8)
            assert seconds == min(ring, tree)
            assert algorithm is (Algorithm.TREE if tree < ring else Algorithm.RING)
    # small all-reduces on many nodes take the tree (log-depth latency), large ones the ring
    assert collective_time_s(1e5, AR, H100, 1024, 8)[1] is Algorithm.TREE
    assert collective_time_s(1e10, AR, H100, 16, 8)[1] is Algorithm.RING
    # inside one node NCCL's model here is the ring
    assert collective_time_s(1e5, AR, H100, 8, 8)[1] is Algorithm.RING


def test_mid_size_messages_reach_less_of_the_bus_and_less_at_scale() -> None:
    """Without the published curve a 16 MiB all-reduce was priced at 1.5x the measured rate on an
    A100 node (the latency term alone does not explain mid sizes)."""
    sizes = [_busbw(H100, s * MIB, AR, 8) for s in (4, 16, 64, 256, 1024)]
    assert sizes == sorted(sizes)
    scales = [_busbw(H100, 64 * MIB, AR, g) for g in (32, 256, 4096)]
    assert scales == sorted(scales, reverse=True)
    a100 = load_hardware("a100-sxm-80gb")
    flat = a100.model_copy(update={"collective_ramps": ()})
    assert _busbw(flat, 16 * MIB, AR, 8) > 1.4 * _busbw(a100, 16 * MIB, AR, 8)
