"""Collectives as NCCL runs them: ring and tree, over every link of a node, with latency terms.

The model is NCCL's own tuning model (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``, NVIDIA/nccl at commit b6475625), Simple protocol (the one large
messages use), with the link speeds and the achieved fraction taken from the profile:

- time = latency + bytes / algorithm bandwidth;
- ring: algorithm bandwidth = bus bandwidth x n / steps, steps = 2(n-1) for an all-reduce and
  n-1 for an all-gather or a reduce-scatter, so the bytes term is the classic
  ``2(n-1)/n V / busbw`` (``(n-1)/n V / busbw``); latency = base + (steps - inter-node steps) x
  intra-node hop + inter-node steps x network hop, with inter-node steps 2 x nodes (all-reduce,
  nodes > 1) or nodes - 1 (all-gather, reduce-scatter);
- tree (all-reduce only): algorithm bandwidth = 0.5 x 0.92 x bus bandwidth, latency = 2 x
  ((GPUs per node - 1) x intra-node hop + log2(nodes) x network hop); NCCL picks the faster of
  the two, and so does ``collective_time_s``;
- bus bandwidth: inside one node, the GPU's NVLink/NVSwitch (or PCIe) bandwidth; across nodes,
  NCCL runs one channel per NIC, so a ring crosses nodes over every NIC of a node at once: the
  GPUs of a node together move ``GPUs per node x NIC bandwidth`` (each GPU has its own NIC in
  DGX/HGX designs), bounded by the intra-node links. Each side times its achieved share, from
  nccl-tests bus bandwidths: ``collective_efficiency`` (NVLink) and ``network_efficiency`` (NICs).

nccl-tests' bus bandwidth (``doc/PERFORMANCE.md``) is defined so that ``busbw = algbw x 2(n-1)/n``
for an all-reduce and ``algbw x (n-1)/n`` for the others: what this module calls bus bandwidth.
"""

from __future__ import annotations

import math
from enum import StrEnum

from hardware.profile import HardwareProfile

# NCCL's tree bandwidth refinement (tuning.cc: ``busBw*.92`` for the tree algorithm) and its
# bus-to-algorithm ratio for trees (``ratio *= .5``).
_TREE_BUS_SHARE = 0.92
_TREE_ALGO_RATIO = 0.5


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"


class Algorithm(StrEnum):
    RING = "ring"
    TREE = "tree"


def nodes_of(n_ranks: int, gpus_per_node: int) -> int:
    return max(1, math.ceil(n_ranks / max(1, gpus_per_node)))


def bus_bandwidth_bytes_per_s(hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> float:
    """What a ring moves per rank per second: the intra-node links inside one node; across nodes
    every NIC of a node (one per GPU), bounded by the intra-node links; times the achieved share."""
    intra = hw.intra_node_bandwidth_bytes_per_s * hw.collective_efficiency
    if nodes_of(n_ranks, gpus_per_node) == 1:
        return intra
    per_node = min(gpus_per_node, n_ranks) * hw.inter_node_bandwidth_bytes_per_s * hw.network_efficiency
    return min(intra, per_node)


def ring_steps(kind: Collective, n_ranks: int, nodes: int) -> tuple[int, int]:
    """(steps, of which cross nodes) of a ring collective (tuning.cc ``nsteps``, ``nInterSteps``)."""
    if kind is Collective.ALL_REDUCE:
        return 2 * (n_ranks - 1), (2 * nodes if nodes > 1 else 0)
    return n_ranks - 1, nodes - 1


def ramp_fraction(hw: HardwareProfile, n_bytes: float, nodes: int) -> float:
    """The share of the large-message bus bandwidth NCCL reaches for ``n_bytes`` on ``nodes``
    nodes, from the profile's published curves (``collective_ramps``): inside a node the one-node
    curve; across nodes interpolated in log(nodes) between the measured scales (clamped). 1 when
    the profile has none."""
    if nodes == 1:
        inside = [r for r in hw.collective_ramps if r.nodes == 1]
        return inside[0].fraction(n_bytes) if inside else 1.0
    across = sorted((r for r in hw.collective_ramps if r.nodes > 1), key=lambda r: r.nodes)
    if not across:
        return 1.0
    if nodes <= across[0].nodes:
        return across[0].fraction(n_bytes)
    if nodes >= across[-1].nodes:
        return across[-1].fraction(n_bytes)
    for low, high in zip(across, across[1:], strict=False):
        if nodes <= high.nodes:
            w = math.log(nodes / low.nodes) / math.log(high.nodes / low.nodes)
            return low.fraction(n_bytes) + w * (high.fraction(n_bytes) - low.fraction(n_bytes))
    return 1.0


def _transfer_s(n_bytes: float, latency_s: float, bandwidth_bytes_per_s: float, ramp: float) -> float:
    """Latency plus the bytes at the link's rate; with a published ramp (which includes the
    latency it measured) the slower of the latency and the bytes at the ramped rate."""
    if ramp >= 1.0:
        return latency_s + n_bytes / bandwidth_bytes_per_s
    return max(latency_s, n_bytes / (bandwidth_bytes_per_s * ramp))


def ring_time_s(n_bytes: float, kind: Collective, hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> float:
    """One ring collective over ``n_bytes`` (the full tensor, not a shard)."""
    if n_ranks <= 1 or n_bytes <= 0:
        return 0.0
    nodes = nodes_of(n_ranks, gpus_per_node)
    steps, inter = ring_steps(kind, n_ranks, nodes)
    latency = (hw.collective_latency_s + (steps - inter) * hw.intra_node_hop_latency_s
               + inter * hw.inter_node_hop_latency_s)
    moved = n_bytes * steps / n_ranks
    return _transfer_s(moved, latency, bus_bandwidth_bytes_per_s(hw, n_ranks, gpus_per_node),
                       ramp_fraction(hw, n_bytes, nodes))


def tree_time_s(n_bytes: float, hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> float:
    """One tree all-reduce (NCCL's double binary tree across nodes, chains inside them)."""
    if n_ranks <= 1 or n_bytes <= 0:
        return 0.0
    nodes = nodes_of(n_ranks, gpus_per_node)
    per_node = min(gpus_per_node, n_ranks)
    latency = 2 * ((per_node - 1) * hw.intra_node_hop_latency_s + math.log2(nodes) * hw.inter_node_hop_latency_s)
    bandwidth = _TREE_ALGO_RATIO * _TREE_BUS_SHARE * bus_bandwidth_bytes_per_s(hw, n_ranks, gpus_per_node)
    return _transfer_s(n_bytes, latency, bandwidth, ramp_fraction(hw, n_bytes, nodes))


def collective_time_s(n_bytes: float, kind: Collective, hw: HardwareProfile, n_ranks: int,
                      gpus_per_node: int) -> tuple[float, Algorithm]:
    """The time NCCL would take and the algorithm it would pick (all-reduce: ring or tree, the
    faster; all-gather and reduce-scatter: ring)."""
    ring = ring_time_s(n_bytes, kind, hw, n_ranks, gpus_per_node)
    if kind is Collective.ALL_REDUCE and nodes_of(n_ranks, gpus_per_node) > 1:
        tree = tree_time_s(n_bytes, hw, n_ranks, gpus_per_node)
        if tree < ring:
            return tree, Algorithm.TREE
    return ring, Algorithm.RING


def collective_lower_bound_s(n_bytes: float, kind: Collective, hw: HardwareProfile, n_ranks: int,
                             gpus_per_node: int) -> float:
    """The ring's bytes term at the links' full speed (no latency, no efficiency): the roofline
    lower bound of a collective."""
    if n_ranks <= 1 or n_bytes <= 0:
        return 0.0
    nodes = nodes_of(n_ranks, gpus_per_node)
    steps, _ = ring_steps(kind, n_ranks, nodes)
    bus = hw.intra_node_bandwidth_bytes_per_s
    if nodes > 1:
        bus = min(bus, min(gpus_per_node, n_ranks) * hw.inter_node_bandwidth_bytes_per_s)
    return n_bytes * steps / n_ranks / bus


def bus_bandwidth_measured(n_bytes: float, kind: Collective, hw: HardwareProfile, n_ranks: int,
                           gpus_per_node: int) -> float:
    """What nccl-tests would print as busbw for this collective: algbw x its bus factor."""
    seconds, _ = collective_time_s(n_bytes, kind, hw, n_ranks, gpus_per_node)
    factor = (2.0 if kind is Collective.ALL_REDUCE else 1.0) * (n_ranks - 1) / n_ranks
    return n_bytes / seconds * factor
