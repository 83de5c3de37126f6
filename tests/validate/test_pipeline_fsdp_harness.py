"""FSDP2 under a pipeline (docs/pipeline_memory.md, "FSDP2 under a pipeline"): one pipeline rank
whose stage is fully_shard-ed over dp_shard = 2 ranks of a fake [pp, dp_shard] mesh, measured by
validate.pipeline_fsdp with the live-storage tracker.

Model: 4 blocks (two per stage at pp = 2), d_model 64, seq 32, micro-batch 1, vocab 512. Every
dimension divides by 2, so padded and unpadded shards coincide."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from planner.model.config import ModelConfig  # noqa: E402
from validate.pipeline import PipelineCase, RankMeasurement, StepRecord, in_flight  # noqa: E402
from validate.pipeline_fsdp import measure_fsdp_rank  # noqa: E402
from validate.pipeline_split import build_stage_models  # noqa: E402
from validate.tracker import rounded_bytes  # noqa: E402

# its module-scoped fixtures are built once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("test_pipeline_fsdp_harness")

TINY = ModelConfig(family="llama", name="pp-fsdp-tiny", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172,
                   vocab_size=512, max_seq_len=64)
T, D, N = 32, 64, 2


def _case(schedule: str = "Schedule1F1B", m: int = 2, v: int = 1, **kwargs: Any) -> PipelineCase:
    return PipelineCase(TINY, pp=2, v=v, schedule=schedule, n_microbatches=m, seq_len=T, dp_shard=N, **kwargs)


def _units(stage: int, n_stages: int = 2) -> list[list[Any]]:
    """The FSDP units of a stage (the root's own parameters, then each block's), unsharded."""
    model = build_stage_models(TINY, torch.float32, n_stages, [stage])[0]
    blocks = [list(block.parameters()) for block in model.blocks.values()]
    in_blocks = {id(p) for unit in blocks for p in unit}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [unit for unit in [root, *blocks] if unit]


def _rows(p: Any) -> int:
    return math.ceil(p.shape[0] / N)


def _gathered(stage: int, c: int, n_stages: int = 2) -> int:  # Ug: one padded storage per parameter
    return sum(rounded_bytes(_rows(p) * N * (p.numel() // p.shape[0]) * c) for u in _units(stage, n_stages) for p in u)


def _unsharded_grads(stage: int, c: int) -> int:
    return sum(rounded_bytes(p.numel() * c) for u in _units(stage) for p in u)


def _shard_elems(unit: list[Any]) -> int:
    return sum(_rows(p) * (p.numel() // p.shape[0]) for p in unit)


def _sharded_params(stage: int) -> int:
    return sum(rounded_bytes(_rows(p) * (p.numel() // p.shape[0]) * 4) for u in _units(stage) for p in u)


def _sharded_grads(stage: int) -> int:  # one reduce-scatter output per unit, fp32
    return sum(rounded_bytes(_shard_elems(u) * 4) for u in _units(stage))


def _of(step: StepRecord, kind: str) -> list:
    return [a for a in step.actions if a.kind == kind]


@pytest.fixture(scope="module")
def last_fp32() -> RankMeasurement:
    return measure_fsdp_rank(_case(), 1)


@pytest.fixture(scope="module")
def first_reshard() -> RankMeasurement:
    return measure_fsdp_rank(_case(m=3, reshard_after_forward=True), 0)


@pytest.fixture(scope="module")
def last_mixed() -> RankMeasurement:
    return measure_fsdp_rank(_case(mixed_precision=True), 1)


@pytest.fixture(scope="module")
def interleaved() -> RankMeasurement:
    return measure_fsdp_rank(_case("ScheduleInterleaved1F1B", v=2), 0)


def test_rank_holds_the_padded_shards_of_its_stages(last_fp32: RankMeasurement, last_mixed: RankMeasurement) -> None:
    assert last_fp32.param_bytes == last_mixed.param_bytes == _sharded_params(1)
    for run in (last_fp32, last_mixed):
        assert all(a.categories["sharded_params"] == _sharded_params(1) for a in run.steps[1].actions)


def test_without_reshard_after_forward_the_stage_stays_gathered_all_step(last_fp32: RankMeasurement) -> None:
    """Gathered at the first forward, kept through every micro-batch (set_reshard_after_backward(False)
    before each backward, stage.py:846), resharded only by perform_reduce_grad."""
    step = last_fp32.steps[1]
    compute = [a for a in step.actions if a.kind in ("F", "L", "B")]
    assert {a.categories["unsharded_params"] for a in compute} == {_gathered(1, 4)}
    assert step.actions[0].categories["unsharded_params"] == 0  # init: sharded at the step's start
    assert _of(step, "REDUCE_GRAD")[0].categories["unsharded_params"] == 0


def test_unsharded_grads_accumulate_until_one_reduce_scatter_per_step(last_fp32: RankMeasurement) -> None:
    step = last_fp32.steps[1]
    backwards = _of(step, "B")
    assert {b.categories["unsharded_grads"] for b in backwards} == {_unsharded_grads(1, 4)}
    assert all(b.categories["sharded_grads"] == 0 for b in backwards)  # no reduce-scatter per micro-batch
    reduce = _of(step, "REDUCE_GRAD")
    assert len(reduce) == 1 and step.actions.index(reduce[0]) > step.actions.index(backwards[-1])
    assert reduce[0].categories["unsharded_grads"] == 0
    assert reduce[0].categories["sharded_grads"] == _sharded_grads(1)
    assert step.categories_after["reduce_scatter"] == 0  # the final callback clears the held input


def test_step_ends_with_shards_gradients_and_buffers(last_fp32: RankMeasurement) -> None:
    after = last_fp32.steps[1].categories_after
    held = {k: v for k, v in after.items() if v}
    assert held == {"sharded_params": _sharded_params(1), "sharded_grads": _sharded_grads(1), "batch": 2 * 2 * T * 8,
                    "fwd_recv": 2 * rounded_bytes(T * D * 4)}


def test_reshard_after_forward_regathers_and_backward_keeps(first_reshard: RankMeasurement) -> None:
    """1F1B rank 0, m 3: F0 F1 B0 F2 B1 B2. Each forward reshards after itself (even what a
    backward left gathered); each backward re-gathers and, set_reshard_after_backward(False), keeps."""
    step = first_reshard.steps[1]
    gathered = _gathered(0, 4)
    by_label = {a.label: a.categories["unsharded_params"] for a in step.actions}
    assert [by_label[x] for x in ("F0@s0", "F1@s0", "B0@s0", "F2@s0", "B1@s0", "B2@s0")] == \
           [0, 0, gathered, 0, gathered, gathered]
    assert max(in_flight(step)) == 2  # the pipeline's in-flight count is unchanged by FSDP


def test_mixed_precision_gathers_bf16_and_accumulates_fp32(last_mixed: RankMeasurement) -> None:
    """MixedPrecisionPolicy(bf16, fp32): bf16 gathered params and activations (receive buffers
    too), the unsharded gradients upcast to fp32 at each post-backward and kept (4.9)."""
    step = last_mixed.steps[1]
    assert {a.categories["unsharded_params"] for a in _of(step, "F")} == {_gathered(1, 2)}
    assert {b.categories["unsharded_grads"] for b in _of(step, "B")} == {_unsharded_grads(1, 4)}
    assert step.categories_after["fwd_recv"] == 2 * rounded_bytes(T * D * 2)
    assert step.categories_after["sharded_grads"] == _sharded_grads(1)
    assert _of(step, "F")[0].categories["outputs"] == rounded_bytes(T * TINY.vocab_size * 2)  # bf16 logits


def test_interleaved_unshards_its_stages_up_front_and_reduces_each_once(interleaved: RankMeasurement) -> None:
    """schedules.py:_add_unshard_reshard (<= 3 active stages): both stages of the rank are
    all-gathered before the first forward; the flat all-gather outputs wait for each stage's
    first forward; REDUCE_GRAD follows each stage's last backward."""
    step = interleaved.steps[1]
    stages = interleaved.stages
    first_forward = next(i for i, a in enumerate(step.actions) if a.kind == "F")
    unshards = [a for a in step.actions[:first_forward] if a.kind == "UNSHARD"]
    assert {a.stage for a in unshards} == set(stages)
    flat = sum(rounded_bytes(_shard_elems(u) * N * 4) for s in stages for u in _units(s, 4))
    assert unshards[-1].categories["all_gather"] == flat
    gathered = sum(_gathered(s, 4, 4) for s in stages)
    assert max(a.categories["unsharded_params"] for a in step.actions) == gathered
    for stage in stages:
        reduce = [i for i, a in enumerate(step.actions) if a.kind == "REDUCE_GRAD" and a.stage == stage]
        last_b = max(i for i, a in enumerate(step.actions) if a.kind == "B" and a.stage == stage)
        assert len(reduce) == 1 and reduce[0] == last_b + 1
