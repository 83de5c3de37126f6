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
  nccl-tests bus bandwidths: ``collective_efficiency`` (NVLink) and ``network_efficiency`` (NICs);
- by message size, published nccl-tests curves (the profile's ``collective_ramps``,
  hardware/ramps.py) give the share of that bus bandwidth a message reaches, keyed on the bytes
  each rank sends. Inside a node the one-node ring curve is the measurement (its latency-bound
  floor included). Across nodes an all-reduce follows the curves measured across nodes
  (interpolated in log(nodes)); an all-gather or a reduce-scatter, rings only, takes the one-node
  curve plus the latency of the extra ring steps (NCCL's per-step latencies above), which is what
  makes a ring's mid-size bus bandwidth fall as it grows.

nccl-tests' bus bandwidth (``doc/PERFORMANCE.md``) is defined so that ``busbw = algbw x 2(n-1)/n``
for an all-reduce and ``algbw x (n-1)/n`` for the others: what this module calls bus bandwidth.

An all-to-all (expert parallelism's dispatch and combine) is no ring: each rank sends 1/n of its
buffer to every other rank at once, its node peers over the intra-node links, the others through its
own NIC, so the slower side bounds it. Where the profile has a published all-to-all curve for the
group's scale (``collective_ramps`` with ``collective: all_to_all``, keyed on the bytes a rank sends,
``size x (n-1)/n``) the bytes run at its share of the profile's all-to-all rate
(``all_to_all_efficiency``, ``all_to_all_network_efficiency``); elsewhere the links' model prices it:
one latency plus the bytes at that rate (``all_to_all_method`` names which).
"""

from __future__ import annotations

import math
from enum import StrEnum

from hardware.profile import HardwareProfile
from hardware.ramps import Collective, CollectiveRamp, bytes_sent_per_rank, ring_step_count

__all__ = ["Algorithm", "Collective", "all_to_all_curves", "all_to_all_method", "all_to_all_time_s",
           "bus_bandwidth_bytes_per_s", "bus_bandwidth_measured", "collective_lower_bound_s",
           "collective_time_s", "nodes_of", "ring_latency_s", "ring_steps", "ring_time_s", "tree_time_s"]

# NCCL's tree bandwidth refinement (tuning.cc: ``busBw*.92`` for the tree algorithm) and its
# bus-to-algorithm ratio for trees (``ratio *= .5``).
_TREE_BUS_SHARE = 0.92
_TREE_ALGO_RATIO = 0.5


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
        return ring_step_count(kind, n_ranks), (2 * nodes if nodes > 1 else 0)
    if kind is Collective.PERMUTE:
        return 1, (1 if nodes > 1 else 0)
    return ring_step_count(kind, n_ranks), nodes - 1


def ring_latency_s(hw: HardwareProfile, kind: Collective, n_ranks: int, nodes: int) -> float:
    """NCCL's ring latency: base + a hop per step, network hops for the steps that cross nodes."""
    steps, inter = ring_steps(kind, n_ranks, nodes)
    return (hw.collective_latency_s + (steps - inter) * hw.intra_node_hop_latency_s
            + inter * hw.inter_node_hop_latency_s)


def _interpolated(curves: list[CollectiveRamp], sent: float, nodes: int) -> float:
    """The share at ``nodes`` between measured scales, linear in log(nodes), clamped at the ends."""
    if nodes <= curves[0].nodes:
        return curves[0].fraction(sent)
    if nodes >= curves[-1].nodes:
        return curves[-1].fraction(sent)
    for low, high in zip(curves, curves[1:], strict=False):
        if nodes <= high.nodes:
            w = math.log(nodes / low.nodes) / math.log(high.nodes / low.nodes)
            return low.fraction(sent) + w * (high.fraction(sent) - low.fraction(sent))
    return 1.0


def ramp_share(hw: HardwareProfile, kind: Collective, sent_bytes: float, n_ranks: int,
               nodes: int) -> tuple[float, int] | None:
    """(share of the large-message bus bandwidth a rank sending ``sent_bytes`` reaches, ranks of
    the curve's run) from the profile's published curves, or None when it has none that apply.

    Inside a node: the one-node curve (the same collective's when there is one: the x axis is the
    bytes per rank, so a ring all-reduce curve serves an all-gather too). Across nodes: curves of
    this collective measured across nodes, interpolated in log(nodes); an all-gather or a
    reduce-scatter (rings only, NCCL has no tree for them) without such curves takes the one-node
    ring curve, and the caller adds the latency of the ring steps its run did not have. A permute
    (one ring step) takes the one-node ring curve inside a node and none across nodes."""
    kinds = (kind,) if kind is Collective.ALL_REDUCE else (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
    if kind is Collective.PERMUTE and nodes > 1:
        return None  # no published send/recv curve across nodes: latency + the bytes at one NIC
    rings = [r for r in hw.collective_ramps if r.collective is not Collective.ALL_TO_ALL]
    if nodes > 1:
        across = sorted((r for r in rings if r.nodes > 1 and r.collective in kinds), key=lambda r: r.nodes)
        if across:
            return _interpolated(across, sent_bytes, nodes), 0
        if kind is Collective.ALL_REDUCE:
            return None
    inside = sorted((r for r in rings if r.nodes == 1), key=lambda r: r.collective not in kinds)
    if not inside:
        return None
    return inside[0].fraction(sent_bytes), inside[0].ranks


def all_to_all_curves(hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> list[CollectiveRamp]:
    """The profile's published all-to-all curves that price a group of ``n_ranks``: inside a node
    its one-node curve, across nodes those measured across nodes (by node count); none: the links'
    model applies."""
    mine = [r for r in hw.collective_ramps if r.collective is Collective.ALL_TO_ALL]
    if nodes_of(n_ranks, gpus_per_node) == 1:
        return [r for r in mine if r.nodes == 1][:1]
    return sorted((r for r in mine if r.nodes > 1), key=lambda r: r.nodes)


def all_to_all_method(hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> str:
    """Which model prices an all-to-all over ``n_ranks`` on ``hw``, in words: the published curve
    (its source) or the links' model (and which achieved share it runs at)."""
    across = nodes_of(n_ranks, gpus_per_node) > 1
    curves = all_to_all_curves(hw, n_ranks, gpus_per_node)
    if curves:
        where = (f"curves measured on {', '.join(str(r.nodes) for r in curves)} nodes, interpolated in log(nodes)"
                 if across else "the one-node curve")
        return f"published all-to-all {where} ({curves[0].source})"
    published = hw.all_to_all_network_efficiency if across else hw.all_to_all_efficiency
    share = "a published all-to-all bus bandwidth" if published is not None else (
        "the ring collectives' share (no published all-to-all figure)")
    link = "each GPU's NIC" if across else "the intra-node links"
    return f"links' model: one latency plus the bytes over {link} at {share}; no published all-to-all curve by size"


def _all_to_all_share(curves: list[CollectiveRamp], sent: float, nodes: int) -> tuple[float, float]:
    """(share of the large-message rate, the first measured bytes per rank): the curves' share at
    ``sent`` (interpolated in log(nodes) between measured scales, clamped at the ends); below the
    first measured point, the share there."""
    first = max(r.sent_bytes()[0] for r in curves)
    at = max(sent, first)
    if len(curves) == 1 or nodes <= curves[0].nodes:
        return curves[0].fraction(max(at, curves[0].sent_bytes()[0])), first
    return _interpolated(curves, at, nodes), first


def all_to_all_time_s(n_bytes: float, hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> float:
    """One all-to-all of ``n_bytes`` per rank (nccl-tests' alltoall size): each rank sends
    ``n_bytes / n`` to every other rank at once, the peers in its node over the intra-node links at
    ``all_to_all_efficiency``, the others through its own NIC at ``all_to_all_network_efficiency``
    (each falls back to the ring collectives' share where the profile has no published all-to-all
    figure); the slower side bounds it.

    With a published curve for the group's scale (``all_to_all_curves``) the bytes run at the
    curve's share of that rate at the bytes a rank sends (the curve includes the latency it
    measured); below its first point, the faster of the first point's time and one latency plus
    the bytes at the first point's share (a curve that starts at large messages says nothing about
    the latency floor). Without one, the links' model: one collective latency and one hop (intra,
    or network when the group spans nodes) plus the bytes at that rate."""
    if n_ranks <= 1 or n_bytes <= 0:
        return 0.0
    nodes = nodes_of(n_ranks, gpus_per_node)
    local = min(gpus_per_node, n_ranks)
    intra = hw.intra_node_bandwidth_bytes_per_s * (hw.all_to_all_efficiency or hw.collective_efficiency)
    nic = hw.inter_node_bandwidth_bytes_per_s * (hw.all_to_all_network_efficiency or hw.network_efficiency)
    inside = n_bytes * (local - 1) / n_ranks / intra
    across = n_bytes * (n_ranks - local) / n_ranks / nic
    hop = hw.inter_node_hop_latency_s if nodes > 1 else hw.intra_node_hop_latency_s
    latency = hw.collective_latency_s + hop
    curves = all_to_all_curves(hw, n_ranks, gpus_per_node)
    if not curves:
        return latency + max(inside, across)
    sent = bytes_sent_per_rank(n_bytes, Collective.ALL_TO_ALL, n_ranks)
    share, first = _all_to_all_share(curves, sent, nodes)
    bytes_s = max(inside, across) / share
    if sent >= first:
        return bytes_s
    return min(bytes_s * first / sent, latency + bytes_s)


def ring_time_s(n_bytes: float, kind: Collective, hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> float:
    """One ring collective over ``n_bytes`` (the full tensor, not a shard): latency plus the bytes
    at the bus bandwidth without a published curve. With one, the bytes at the curve's share of it:
    inside a node that is the measurement, latency-bound floor included (NCCL's small messages run
    the LL protocols, faster than the Simple latency); across nodes plus the latency of the ring
    steps the curve's run did not have, and never under the ring's latency."""
    if n_ranks <= 1 or n_bytes <= 0:
        return 0.0
    nodes = nodes_of(n_ranks, gpus_per_node)
    latency = ring_latency_s(hw, kind, n_ranks, nodes)
    sent = bytes_sent_per_rank(n_bytes, kind, n_ranks)
    bus = bus_bandwidth_bytes_per_s(hw, n_ranks, gpus_per_node)
    if kind is Collective.PERMUTE and nodes > 1:  # the rank at a node's edge sends over its own NIC
        bus = min(bus, hw.inter_node_bandwidth_bytes_per_s * hw.network_efficiency)
    ramp = ramp_share(hw, kind, sent, n_ranks, nodes)
    if ramp is None:
        return latency + sent / bus
    share, measured_ranks = ramp
    if nodes == 1:
        return sent / (bus * share)  # the curve measured on a node, its latency-bound floor included
    extra = 0.0
    if measured_ranks and n_ranks > measured_ranks:
        extra = latency - ring_latency_s(hw, kind, measured_ranks, 1)
    return max(latency, sent / (bus * share) + extra)


def tree_time_s(n_bytes: float, hw: HardwareProfile, n_ranks: int, gpus_per_node: int) -> float:
    """One tree all-reduce (NCCL's double binary tree across nodes, chains inside them)."""
    if n_ranks <= 1 or n_bytes <= 0:
        return 0.0
    nodes = nodes_of(n_ranks, gpus_per_node)
    per_node = min(gpus_per_node, n_ranks)
    latency = 2 * ((per_node - 1) * hw.intra_node_hop_latency_s + math.log2(nodes) * hw.inter_node_hop_latency_s)
    bandwidth = _TREE_ALGO_RATIO * _TREE_BUS_SHARE * bus_bandwidth_bytes_per_s(hw, n_ranks, gpus_per_node)
    ramp = ramp_share(hw, Collective.ALL_REDUCE, bytes_sent_per_rank(n_bytes, Collective.ALL_REDUCE, n_ranks), n_ranks,
                      nodes)
    if ramp is None:
        return latency + n_bytes / bandwidth
    return max(latency, n_bytes / (bandwidth * ramp[0]))


def collective_time_s(n_bytes: float, kind: Collective, hw: HardwareProfile, n_ranks: int,
                      gpus_per_node: int) -> tuple[float, Algorithm]:
    """The time NCCL would take and the algorithm it would pick (all-reduce: ring or tree, the
    faster; all-gather and reduce-scatter: ring)."""
    if kind is Collective.ALL_TO_ALL:
        return all_to_all_time_s(n_bytes, hw, n_ranks, gpus_per_node), Algorithm.RING
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
