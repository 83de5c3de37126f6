"""Simulations in one process one after another: a fake process group leaves no DTensor decision
behind that names its (destroyed) groups."""

from __future__ import annotations

import pytest

from planner.plan.parallel_dims import ParallelDims

torch = pytest.importorskip("torch")


def _rowwise_step(dims: ParallelDims) -> torch.Tensor:
    """A rowwise matmul (partial sums reduce-scattered) and its backward on the tp mesh."""
    from torch.distributed.tensor import DTensor, Shard

    from validate.distributed import fake_process_group

    with fake_process_group(dims) as mesh:
        tp = mesh["tp"]
        x = DTensor.from_local(torch.ones(8, 4, requires_grad=True), tp, [Shard(1)])
        w = DTensor.from_local(torch.ones(4, 8, requires_grad=True), tp, [Shard(0)])
        out = (x @ w).redistribute(tp, [Shard(0)])
        out.to_local().sum().backward()
        return out.to_local()


def test_a_second_process_group_runs_on_an_equal_mesh() -> None:
    """DeviceMesh equality ignores the process group (torch 2.13): the tensor-parallel meshes of
    these two layouts are equal, their groups' names are not, and DTensor's caches would hand the
    second run the first run's mesh, whose group is gone ("Could not resolve the process group
    registered under the name ..."); ``validate.distributed.forget_meshes`` drops them."""
    _rowwise_step(ParallelDims.data_parallel_of(4, 3, tp=2, sp=True, ep=2))  # more groups: other names
    assert _rowwise_step(ParallelDims.data_parallel_of(4, 3, tp=2, sp=True)).shape == (4, 8)
