"""Collectives as NCCL runs them, checked against published nccl-tests bus bandwidths
(docs/kernel_benchmarks.md section 4, GTC24 S62129 slide 12 and the NCCL maintainers' figures)."""

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
from hardware.registry import load_hardware

GIB = 2**30


# nccl-tests all_reduce bus bandwidth for large messages, GB/s (GTC24 S62129 slide 12; the NCCL
# maintainers quote ~370 GB/s on H100 NVLink without SHARP). Tolerance 5%: the profiles' efficiencies
# are these figures over the link rates, so this checks the model's algebra end to end.
@pytest.mark.parametrize(("profile", "gpus", "published_gb_s"), [
    ("a100-sxm-80gb", 8, 232),   # one DGX A100, NVLink 3
    ("h100-sxm", 8, 370),        # one DGX H100, NVLink 4, ring (no NVLS)
    ("a100-sxm-80gb", 16, 192),  # DGX A100 across nodes, 8 x 200 Gb/s HDR
    ("h100-sxm", 16, 380),       # DGX H100 across nodes, 8 x 400 Gb/s NDR
])
def test_all_reduce_bus_bandwidth_matches_nccl_tests(profile: str, gpus: int, published_gb_s: float) -> None:
    hw = load_hardware(profile)
    busbw = bus_bandwidth_measured(8 * GIB, Collective.ALL_REDUCE, hw, gpus, 8)
    assert busbw / 1e9 == pytest.approx(published_gb_s, rel=0.05)


def test_multi_node_rings_use_every_nic_of_a_node() -> None:
    """Regression: across nodes the ring was priced at one GPU's NIC (50 GB/s on a DGX H100),
    8x too slow; NCCL runs a channel per NIC. The bus bandwidth stays flat from 2 to 64 nodes for
    large messages (as in published scans), bounded by NVLink."""
    hw = load_hardware("h100-sxm")
    one_nic = hw.inter_node_bandwidth_bytes_per_s
    for gpus in (16, 64, 512):
        busbw = bus_bandwidth_measured(16 * GIB, Collective.ALL_GATHER, hw, gpus, 8)
        assert busbw > 6 * one_nic
        assert busbw <= hw.intra_node_bandwidth_bytes_per_s


def test_ring_steps_follow_nccl() -> None:
    assert ring_steps(Collective.ALL_REDUCE, 16, 2) == (30, 4)
    assert ring_steps(Collective.ALL_GATHER, 16, 2) == (15, 1)
    assert ring_steps(Collective.REDUCE_SCATTER, 8, 1) == (7, 0)


def test_latency_dominates_small_messages_and_grows_with_ranks() -> None:
    hw = load_hardware("h100-sxm")
    small = [ring_time_s(1e5, Collective.ALL_GATHER, hw, n, 8) for n in (8, 64, 512)]
    assert small == sorted(small)
    assert small[-1] > 10 * small[0]  # hundreds of ring steps of latency at 512 ranks


def test_all_reduce_picks_the_faster_of_ring_and_tree() -> None:
    hw = load_hardware("h100-sxm")
    for n_bytes in (1e5, 1e7, 1e9, 1e10):
        for gpus in (16, 128, 1024):
            seconds, algorithm = collective_time_s(n_bytes, Collective.ALL_REDUCE, hw, gpus, 8)
            ring = ring_time_s(n_bytes, Collective.ALL_REDUCE, hw, gpus, 8)
            tree = tree_time_s(n_bytes, hw, gpus, 8)
            assert seconds == min(ring, tree)
            assert algorithm is (Algorithm.TREE if tree < ring else Algorithm.RING)
    # small all-reduces on many nodes take the tree (log-depth latency), large ones the ring
    assert collective_time_s(1e5, Collective.ALL_REDUCE, hw, 1024, 8)[1] is Algorithm.TREE
    assert collective_time_s(1e10, Collective.ALL_REDUCE, hw, 16, 8)[1] is Algorithm.RING
    # inside one node NCCL's model here is the ring
    assert collective_time_s(1e5, Collective.ALL_REDUCE, hw, 8, 8)[1] is Algorithm.RING
