"""A permute (torch's ``permute_tensor``: each rank sends its buffer to the next rank, NCCL
send/recv), as context parallelism's ring passes key/value gradients: one step of a ring."""

from __future__ import annotations

import pytest

from hardware.collectives import Collective, collective_lower_bound_s, collective_time_s
from hardware.registry import load_hardware

HW = load_hardware("h100-sxm")


@pytest.mark.parametrize("buffer_bytes", [2**20, 2**26, 2**30])
def test_inside_a_node_a_permute_is_one_ring_step(buffer_bytes: int) -> None:
    """Each rank sends its whole buffer once, as each rank of a 2-rank all-gather does: the same
    time, whatever the group size inside the node (a ring's steps run one after another, the
    permute's transfers all at once)."""
    pair, _ = collective_time_s(2 * buffer_bytes, Collective.ALL_GATHER, HW, 2, 8)
    for ranks in (2, 4, 8):
        seconds, _ = collective_time_s(ranks * buffer_bytes, Collective.PERMUTE, HW, ranks, 8)
        assert seconds == pytest.approx(pair, rel=1e-9)


def test_across_nodes_a_permute_runs_at_one_nic() -> None:
    """The rank at a node's edge sends over its own NIC: large buffers approach the NIC's achieved
    bandwidth (400 Gb/s on an H100 SXM node's per-GPU NIC), not the node's aggregate."""
    buffer = 2**30
    seconds, _ = collective_time_s(16 * buffer, Collective.PERMUTE, HW, 16, 8)
    nic = HW.inter_node_bandwidth_bytes_per_s * HW.network_efficiency
    assert buffer / seconds == pytest.approx(nic, rel=0.02)
    assert buffer / seconds < HW.intra_node_bandwidth_bytes_per_s * HW.collective_efficiency
    assert collective_lower_bound_s(16 * buffer, Collective.PERMUTE, HW, 16, 8) > 0
