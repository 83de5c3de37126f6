"""The lower bounds that let the least-memory search skip a point without solving it.

``static_floor_bytes`` (the static memory and the step's temporaries, no walk),
``optimizer_step_bytes`` (the live bytes at the optimizer step: no activation is left) and
``forward_floor_bytes`` (the forward and optimizer-step events of the walk with every block
checkpointed whole) must lie at or below the peak of every placement the solver could choose:
every subset of blocks under each policy, and for the first every uniform segmentation where the
strategy allows segments. ``least_memory_at`` with a threshold must answer as without one
whenever the least memory is within it, and otherwise a figure above it.
"""

from __future__ import annotations

import itertools

import pytest

from hardware.registry import load_hardware
from planner.memory.placement import optimizer_step_bytes
from planner.memory.step import checkpoint_units, simulate_step
from planner.model.config import ModelConfig, TrainConfig
from planner.parallel.strategies import strategy_for
from planner.plan.checkpointing import CheckpointPolicy
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.program.estimate import (
    check_knobs,
    device_bytes,
    estimate,
    peak_lower_bound,
    rank_graph,
    static_for,
    step_time_s,
)
from search.candidates import forward_floor_bytes, least_memory_at, segment_plans, static_floor_bytes

HW = load_hardware("h100-sxm")
LLAMA = ModelConfig(family="llama", n_layers=5, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=4096)
GPT = ModelConfig(family="gpt2", n_layers=5, d_model=64, n_heads=2, d_ff=256, vocab_size=512, max_seq_len=64, attention="eager",
                  dropout=0.1)
MOE = ModelConfig(family="mixtral", n_layers=5, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                  moe={"n_experts": 4, "top_k": 2, "d_ff_expert": 64, "first_dense_layers": 2})
POLICIES = (CheckpointPolicy.FULL, CheckpointPolicy.OPS)
CASES = [
    # model, precision, accumulation, GPUs, ZeRO stage, expert parallelism
    pytest.param(LLAMA, "bf16-mixed", 2, 1, 0, 1, id="llama-one-gpu-autocast"),
    pytest.param(GPT, "fp32", 1, 4, 0, 1, id="gpt2-ddp-dropout"),
    pytest.param(LLAMA, "bf16-mixed", 3, 4, 1, 1, id="llama-zero1"),
    pytest.param(LLAMA, "fp32", 2, 2, 2, 1, id="llama-zero2"),
    pytest.param(MOE, "bf16-mixed", 2, 4, 2, 2, id="moe-zero2-ep2"),
    pytest.param(MOE, "fp32", 1, 4, 2, 4, id="moe-zero2-ep4-one-rank-experts"),
    pytest.param(MOE, "bf16-mixed", 2, 4, 3, 2, id="moe-zero3-ep2"),
    pytest.param(LLAMA, "bf16-mixed", 3, 4, 3, 1, id="llama-zero3-sync-last"),
]


def _setup(model: ModelConfig, precision: str, accum: int, gpus: int, stage: int, ep: int):  # noqa: ANN202
    training = TrainConfig(seq_len=64, global_batch_size=2 * accum * gpus, optimizer_impl="foreach")
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accum, precision=precision,
                  parallel=ParallelDims.data_parallel_of(gpus, stage, ep=ep),
                  fsdp_grad_sync="last" if stage >= 2 and accum == 3 else "every")
    graph = rank_graph(model, training, knobs, check_knobs(model, training, HW, knobs), HW)
    return training, knobs, graph, static_for(graph, HW, training, knobs)


@pytest.mark.parametrize(("model", "precision", "accum", "gpus", "stage", "ep"), CASES)
def test_floors_bound_every_placement(model: ModelConfig, precision: str, accum: int, gpus: int, stage: int,
                                      ep: int) -> None:
    _, knobs, graph, static, = _setup(model, precision, accum, gpus, stage, ep)
    n = model.n_layers

    def walk(units: dict[int, int]):  # noqa: ANN202
        return simulate_step(graph, static, HW.round_alloc, units, knobs.schedule, record_trace=True)

    every = walk(checkpoint_units(n, tuple(range(n))))
    step, forward = optimizer_step_bytes(every), forward_floor_bytes(every)
    assert static_floor_bytes(static) <= step <= forward
    for policy, bits in itertools.product(POLICIES, itertools.product((0, 1), repeat=n)):
        timeline = walk(checkpoint_units(n, [i for i, b in enumerate(bits) if b], (), policy, knobs.save_list))
        assert optimizer_step_bytes(timeline) == step
        assert forward <= timeline.peak.bytes
    if strategy_for(knobs.parallel).allows_segments:
        for plan in segment_plans(n):
            assert optimizer_step_bytes(walk(checkpoint_units(n, (), plan))) == step


@pytest.mark.parametrize(("model", "precision", "accum", "gpus", "stage", "ep"), CASES)
def test_a_threshold_changes_no_answer_within_it(model: ModelConfig, precision: str, accum: int, gpus: int,
                                                 stage: int, ep: int) -> None:
    training, knobs, graph, static = _setup(model, precision, accum, gpus, stage, ep)
    knobs_least, peak = least_memory_at(model, training, HW, knobs, policies=POLICIES)
    least = device_bytes(peak, HW)
    for above in (least - 1, least, least + 1, 2 * least):
        found, bound = least_memory_at(model, training, HW, knobs, policies=POLICIES, above_bytes=above)
        if least <= above:
            assert (found, bound) == (knobs_least, peak)
        else:
            assert device_bytes(bound, HW) > above and bound <= peak


@pytest.mark.parametrize(("model", "precision", "accum", "gpus", "stage", "ep"), CASES)
def test_the_pruning_bound_is_below_the_least_memory(model: ModelConfig, precision: str, accum: int, gpus: int,
                                                     stage: int, ep: int) -> None:
    """``peak_lower_bound`` (no graph: ZeRO-2's gathered parameters included) orders and prunes the
    points of ``search.smallest``: it must not exceed the least peak of any placement."""
    training, knobs, _, _ = _setup(model, precision, accum, gpus, stage, ep)
    _, least = least_memory_at(model, training, HW, knobs, policies=POLICIES)
    assert peak_lower_bound(model, training, HW, knobs) <= least


@pytest.mark.parametrize(("blocks", "segments", "policy"), [
    ((), (), CheckpointPolicy.FULL), ((0, 3), (), CheckpointPolicy.FULL), ((1, 2, 4), (), CheckpointPolicy.OPS),
    ((0,), (), CheckpointPolicy.ATTENTION), ((), ((0, 1), (2, 4)), CheckpointPolicy.FULL)])
def test_step_time_without_a_walk_equals_the_estimate(blocks: tuple[int, ...], segments: tuple[tuple[int, int], ...],
                                                      policy: CheckpointPolicy) -> None:
    """``step_time_s`` (the ops checkpointing re-runs from the placement alone) breaks the smallest
    plan's ties without a walk: it must equal ``estimate``'s, which takes them from the walk."""
    for model, stage in ((LLAMA, 0), (MOE, 3)):
        training = TrainConfig(seq_len=64, global_batch_size=16, optimizer_impl="foreach")
        knobs = Knobs(micro_batch_size=2, grad_accum_steps=2, precision="bf16-mixed", checkpoint_blocks=blocks,
                      checkpoint_segments=segments if stage == 0 else (), checkpoint_policy=policy,
                      parallel=ParallelDims.data_parallel_of(4, stage))
        assert step_time_s(model, training, HW, knobs) == estimate(model, training, HW, knobs).step_time_s
