"""The node a job's GPUs sit in is set once (``api.system``: the profile's ``gpus_per_node``, or
``--gpus-per-node``) and read off the hardware profile everywhere after; plan files carry it."""

from __future__ import annotations

import json

import pytest

from planner.errors import ConfigError
from planner.program.results import PlanResult
from roofplan import api

MODEL, TRAINING = api.load_model("tiny-llama", global_batch_size=64)


def test_the_profile_says_the_node_and_the_flag_overrides_it() -> None:
    assert api.system("h100-sxm", None).gpus_per_node == 8
    assert api.system("h100-sxm", 2).gpus_per_node == 2
    with pytest.raises(ConfigError, match="--gpus-per-node: must be positive"):
        api.system("h100-sxm", 0)


def test_a_smaller_node_prices_the_collectives_across_nodes(tmp_path) -> None:  # noqa: ANN001
    knobs = api.Knobs(micro_batch_size=1, grad_accum_steps=2, data_parallel=32, zero_stage=3)
    one_node = api.estimate_plan(MODEL, TRAINING, "h100-sxm", knobs, gpus_per_node=32)
    four_nodes = api.estimate_plan(MODEL, TRAINING, "h100-sxm", knobs, gpus_per_node=8)
    assert one_node.hardware.gpus_per_node == one_node.parallel.gpus_per_node == 32
    assert four_nodes.hardware.gpus_per_node == four_nodes.parallel.gpus_per_node == 8
    assert four_nodes.best.estimate.time.communication_s > one_node.best.estimate.time.communication_s
    path = four_nodes.save(tmp_path / "plan.json")
    assert PlanResult.load(path).hardware.gpus_per_node == 8


def test_a_plan_file_from_before_profiles_had_nodes_takes_the_layouts(tmp_path) -> None:  # noqa: ANN001
    knobs = api.Knobs(micro_batch_size=1, grad_accum_steps=2, data_parallel=32, zero_stage=3)
    plan = api.estimate_plan(MODEL, TRAINING, "h100-sxm", knobs, gpus_per_node=4)
    data = json.loads(plan.to_json())
    del data["hardware"]["gpus_per_node"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert PlanResult.load(path).hardware.gpus_per_node == 4
