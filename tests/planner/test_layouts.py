"""planner.plan.layouts, the one authority on which parallel layouts exist: the layouts it enumerates
are exactly the valid ones, its refusals name the flag, and the mesh it lays out puts the same
ranks of each group on a node as the closed form it replaced."""

from __future__ import annotations

import itertools

import pytest

from planner.errors import ConfigError
from planner.model.config import TrainConfig
from planner.model.sources import resolve
from planner.plan.layouts import (
    LayoutRequest,
    as_flag,
    as_flags,
    check_fixed_request,
    checked_request,
    fixed_layout,
    layout_at,
    layout_choices,
    valid_layouts,
)
from planner.plan.parallel_dims import Group, MeshAxis, ParallelDims

LLAMA, _ = resolve("tiny-llama")
MOE, _ = resolve("mixtral-8x7b")
TRAINING = TrainConfig(seq_len=16384, global_batch_size=8)


def _layouts(gpus: int) -> list[ParallelDims]:
    found = (layout_at(gpus, True, stage, tp, cp, ep)
             for stage, tp, cp, ep in itertools.product(range(4), (1, 2, 4, 8), (1, 2, 4), (1, 2, 4, 8)))
    hsdp = (layout_at(gpus, True, stage, tp, 1, 1, 1, replicas)
            for stage, tp, replicas in itertools.product((2, 3), (1, 2, 4), (2, 4)))
    return [dims for dims in (*found, *hsdp) if dims is not None]


@pytest.mark.parametrize("gpus", [1, 2, 8, 16, 64])
def test_ranks_per_node_follow_the_mesh_as_the_closed_form_did(gpus: int) -> None:
    """tp innermost, then cp, then data parallelism (ep: consecutive data-parallel ranks)."""
    for dims in _layouts(gpus):
        assert dict(dims.mesh).get(MeshAxis.TP, 1) == dims.tp and dims.world_size == gpus
        for group, per_node in itertools.product(Group, (1, 2, 4, 8)):
            inner = {Group.TP: 1, Group.CP: dims.tp, Group.DP: dims.tp * dims.cp, Group.FSDP: dims.tp,
                     Group.EP: dims.tp * dims.cp, Group.PP: dims.world_size // dims.pp,
                     Group.REPLICATE: dims.tp * dims.cp * dims.dp_shard}[group]
            size = {Group.TP: dims.tp, Group.CP: dims.cp, Group.DP: dims.data_parallel, Group.FSDP: dims.fsdp_ranks,
                    Group.EP: dims.ep, Group.PP: dims.pp, Group.REPLICATE: dims.dp_replicate if dims.hsdp else 1}[group]
            assert dims.ranks_per_node(group, per_node) == max(1, min(size, per_node // inner))


def test_layout_at_is_the_layout_or_none() -> None:
    assert layout_at(8, True, 3, 2, 2, 1) == ParallelDims.data_parallel_of(8, 3, tp=2, sp=True, cp=2)
    assert layout_at(8, True, 0, 2) is None  # TP beside DDP replicas: torchtitan runs FSDP2 x TP
    assert layout_at(2, True, 0, 2) == ParallelDims(tp=2, sp=True)  # TP alone
    assert layout_at(8, True, 1, 1, 2) is None  # CP under ZeRO-1
    assert layout_at(8, True, 3, 1, 1, 8) is not None and layout_at(8, True, 3, 2, 1, 8) is None  # ep divides dp


def test_valid_layouts_are_the_search_spaces() -> None:
    request = LayoutRequest(gpus=8)
    layouts = valid_layouts(MOE, TRAINING, request, 8)
    assert len(set(layouts)) == len(layouts) and all(dims.world_size == 8 for dims in layouts)
    assert all(TRAINING.global_batch_size % dims.data_parallel == 0 for dims in layouts)
    assert ParallelDims.data_parallel_of(8, 3, ep=8) in layouts
    choices = layout_choices(MOE, TRAINING, request, 8)
    assert list(choices.dimensions()) == ["zero_stage", "tp", "cp", "ep"]
    assert layout_choices(LLAMA, TRAINING, LayoutRequest(gpus=1), 8).dimensions() == {"zero_stage": (0,)}


@pytest.mark.parametrize(("request_", "says"), [
    (LayoutRequest(gpus=1, tp=2), "--tp: 2 needs several GPUs"),
    (LayoutRequest(gpus=8, cp=2, zero_stage=1), "--cp: context parallelism runs with FSDP2"),
])
def test_contradicting_flags_are_refused(request_: LayoutRequest, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        checked_request(LLAMA, request_)


def test_a_fixed_request_is_its_layout_or_one_line_naming_the_flags() -> None:
    request = checked_request(LLAMA, LayoutRequest(gpus=8, zero_stage=3, tp=2, cp=1))
    assert request.fixed and request.ep == 1
    check_fixed_request(LLAMA, TRAINING, request, 8)
    assert fixed_layout(request) == ParallelDims.data_parallel_of(8, 3, tp=2, sp=True)
    with pytest.raises(ConfigError, match="--tp x --cp x --pp: 4 x 4 x 1 must divide the 8 GPUs"):
        check_fixed_request(LLAMA, TRAINING, request.model_copy(update={"tp": 4, "cp": 4}), 8)
    with pytest.raises(ConfigError, match="--zero-stage / --tp / --cp / --ep / --pp: parallel.ep"):
        fixed_layout(LayoutRequest(gpus=8, zero_stage=0, tp=1, cp=1, ep=2))


def test_refusals_and_layouts_in_the_flags_words() -> None:
    assert as_flag("parallel.cp: use cp 1") == "--cp: use cp 1"
    assert as_flag("moe.aux_loss_coef: use tp 1") == "moe.aux_loss_coef: use tp 1"
    dims = ParallelDims.data_parallel_of(16, 3, tp=2, sp=True, cp=2)
    assert as_flags(dims) == "--gpus 16 --zero-stage 3 --tp 2 --cp 2"
