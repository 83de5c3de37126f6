"""Published nccl-tests bus-bandwidth curves by message size (profile data) and the collectives
they describe.

A curve is stored as nccl-tests printed it: the collective, the scale (nodes x GPUs per node), the
message sizes (``size`` column: the full tensor, for an all-gather the gathered array) and the bus
bandwidths. Its x axis for the time model is the bytes each rank sends, ``size x steps / ranks``
(steps: 2(n-1) for an all-reduce, n-1 for an all-gather or a reduce-scatter): a ring's pipeline
fills with the traffic per rank, so one curve serves every ring collective. All-to-all curves
(``collective: all_to_all``) price only all-to-alls (hardware/collectives.py), keyed on the bytes a
rank sends to the others, ``size x (n-1)/n``. Checked on one H100
node, where the ring all-reduce at size S matches the all-gather and the reduce-scatter at 2S
(tests/hardware/test_collectives.py).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    # every rank sends its buffer to the next rank of the group (torch's ``permute_tensor``, an
    # all_to_all_single with one peer, NCCL send/recv): one step of a ring. Its size is the group's
    # buffers together, as an all-gather's is its output
    PERMUTE = "permute"
    # every rank sends a 1/n share of its buffer to each other rank of the group (NCCL's
    # all-to-all: n - 1 concurrent send/recv pairs, not a ring). Its size is one rank's buffer,
    # as nccl-tests' alltoall counts it
    ALL_TO_ALL = "all_to_all"


def ring_step_count(kind: Collective, n_ranks: int) -> int:
    """Steps of a ring over ``n_ranks`` (NCCL tuning.cc ``nsteps``; a permute is one step)."""
    if kind is Collective.PERMUTE:
        return 1
    return 2 * (n_ranks - 1) if kind is Collective.ALL_REDUCE else n_ranks - 1


def bytes_sent_per_rank(n_bytes: float, kind: Collective, n_ranks: int) -> float:
    """What each rank of a ring sends for a collective over ``n_bytes`` (the full tensor); for an
    all-to-all (``n_bytes`` one rank's buffer) what it sends to the other ranks, ``n_bytes (n-1)/n``."""
    return n_bytes * ring_step_count(kind, n_ranks) / max(1, n_ranks)


PositiveFloat = Annotated[float, Field(gt=0)]


class CollectiveRamp(BaseModel):
    """A published nccl-tests bus-bandwidth curve by message size, at one scale: the share of the
    large-message bus bandwidth NCCL reaches at each size (its protocols, channels and pipelining
    ramp up with the message, and the curve includes the latency it measured)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    nodes: int = Field(gt=0, description="1: inside one node; else the number of nodes measured")
    gpus_per_node: int = Field(default=8, gt=0, description="GPUs of each node in the measured run")
    collective: Collective = Field(default=Collective.ALL_REDUCE, description="the nccl-tests binary measured")
    sizes_bytes: tuple[PositiveFloat, ...]
    busbw_gb_s: tuple[PositiveFloat, ...]
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _increasing(self) -> CollectiveRamp:
        if len(self.sizes_bytes) != len(self.busbw_gb_s) or len(self.sizes_bytes) < 2 or any(
                b <= a for a, b in zip(self.sizes_bytes, self.sizes_bytes[1:], strict=False)):
            raise ValueError(f"collective ramp ({self.nodes} nodes): sizes_bytes must increase and match busbw_gb_s")
        return self

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def sent_bytes(self) -> tuple[float, ...]:
        """The curve's x axis: the bytes each rank sent at each measured size."""
        return tuple(bytes_sent_per_rank(s, self.collective, self.ranks) for s in self.sizes_bytes)

    def fraction(self, sent_bytes: float) -> float:
        """busbw over busbw at the largest size, for a rank sending ``sent_bytes``: interpolated
        linearly in log busbw over log size (a power law between points, so a latency-bound
        stretch, busbw in proportion to size, is followed exactly); above the curve 1; below its
        first point the time of the first point (the latency-bound floor the run measured), so the
        share falls in proportion to the bytes."""
        xs, ys, top = self.sent_bytes(), self.busbw_gb_s, self.busbw_gb_s[-1]
        if sent_bytes >= xs[-1]:
            return 1.0
        if sent_bytes <= xs[0]:
            return ys[0] / top * sent_bytes / xs[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys, strict=True), zip(xs[1:], ys[1:], strict=True), strict=True):
            if sent_bytes <= x1:
                w = math.log(sent_bytes / x0) / math.log(x1 / x0)
                return min(1.0, y0 * (y1 / y0) ** w / top)
        return 1.0
