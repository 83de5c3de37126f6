"""The bounds that let the smallest plan and the fewest-GPUs advice skip points without a walk or
a graph (``search.bounds``), and the smallest plan's tie rule.

``step_floor_bound`` (no graph) must lie at or below the static floor of every micro-batch of a
layout, and ``static_floor_at`` (one graph per layout) must equal each micro-batch's own static
floor; the smallest plan must be the least (device bytes, micro-batch, step time) over every
point, each priced exactly on its own.
"""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.precision import PrecisionPolicy
from planner.program.estimate import check_knobs, device_bytes, rank_graph, static_for, step_time_s
from search.bounds import static_floor_at, static_floor_bytes, step_floor_bound
from search.candidates import least_memory_at
from search.smallest import smallest_plan
from search.space import build_space

HW = load_hardware("h100-sxm")
LLAMA = ModelConfig(family="llama", n_layers=5, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=4096)
GPT = ModelConfig(family="gpt2", n_layers=5, d_model=64, n_heads=2, d_ff=256, vocab_size=512, max_seq_len=64,
                  attention="eager", dropout=0.1)
MOE = ModelConfig(family="mixtral", n_layers=5, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                  moe={"n_experts": 4, "top_k": 2, "d_ff_expert": 64, "first_dense_layers": 2})
CASES = [
    # model, precision, GPUs, ZeRO stage, tensor parallelism, expert parallelism, optimizer, implementation
    pytest.param(LLAMA, "bf16-mixed", 1, 0, 1, 1, "adamw", "foreach", id="llama-one-gpu"),
    pytest.param(GPT, "fp32", 4, 0, 1, 1, "adamw", "fused", id="gpt2-ddp-fused"),
    pytest.param(LLAMA, "bf16-mixed", 4, 1, 1, 1, "adamw", "foreach", id="llama-zero1"),
    pytest.param(GPT, "fp16-mixed", 3, 1, 1, 1, "sgd-momentum", "foreach", id="gpt2-zero1-uneven-sgd"),
    pytest.param(LLAMA, "fp32", 2, 2, 1, 1, "adamw", "foreach", id="llama-zero2"),
    pytest.param(LLAMA, "bf16-true", 4, 3, 2, 1, "adamw", "foreach", id="llama-zero3-tp2"),
    pytest.param(MOE, "bf16-mixed", 4, 2, 1, 2, "adamw", "foreach", id="moe-zero2-ep2"),
    pytest.param(MOE, "bf16-mixed", 4, 3, 1, 4, "adamw", "fused", id="moe-zero3-ep4"),
    pytest.param(MOE, "fp32", 2, 0, 1, 1, "sgd", "foreach", id="moe-ddp-sgd"),
]


@pytest.mark.parametrize(("model", "precision", "gpus", "stage", "tp", "ep", "optimizer", "impl"), CASES)
def test_the_step_floors_hold_at_every_micro_batch(model: ModelConfig, precision: str, gpus: int, stage: int,
                                                   tp: int, ep: int, optimizer: str, impl: str) -> None:
    per_rank = 12
    training = TrainConfig(seq_len=64, global_batch_size=per_rank * gpus // tp, optimizer=optimizer,
                           optimizer_impl=impl)
    dims = ParallelDims.data_parallel_of(gpus, stage, tp=tp, ep=ep, sp=tp > 1)
    floors = set()
    for mb in (1, 2, 3, 4, 6, 12):
        knobs = Knobs(micro_batch_size=mb, grad_accum_steps=per_rank // mb, precision=precision, parallel=dims)
        graph = rank_graph(model, training, knobs, check_knobs(model, training, HW, knobs), HW)
        exact = static_floor_bytes(static_for(graph, HW, training, knobs))
        assert step_floor_bound(model, training, HW, knobs) <= exact
        assert static_floor_at(model, training, HW, knobs) == exact
        floors.add(exact)
    assert len(floors) == 1  # the optimizer step does not depend on the micro-batch


@pytest.mark.parametrize(("model", "seq", "batch", "gpus", "precisions"), [
    (LLAMA, 64, 8, 1, (PrecisionPolicy.BF16_MIXED, PrecisionPolicy.FP32)),
    (LLAMA, 64, 16, 4, (PrecisionPolicy.BF16_MIXED,)),
    (GPT, 32, 12, 2, (PrecisionPolicy.FP32, PrecisionPolicy.BF16_MIXED)),
    (MOE, 64, 8, 4, (PrecisionPolicy.BF16_MIXED,)),
])
def test_ties_go_to_the_smaller_micro_batch_then_the_faster_plan(model: ModelConfig, seq: int, batch: int,
                                                                 gpus: int, precisions: tuple[PrecisionPolicy, ...]
                                                                 ) -> None:
    """Every point priced alone (its least memory, its plan, that plan's step time): the smallest
    plan is the least (device bytes, micro-batch, step time) of them."""
    training = TrainConfig(seq_len=seq, global_batch_size=batch)
    space = build_space(model, training, HW, precisions, gpus=gpus, zero_stage=None, expert_parallel=None)
    keys = []
    for point in space.points():
        knobs, peak = least_memory_at(model, training, HW, space.knobs_at(training, point), None,
                                      space.allow_segments, space.checkpoint_policies)
        keys.append((device_bytes(peak, HW), knobs.micro_batch_size, step_time_s(model, training, HW, knobs)))
    found = smallest_plan(model, training, HW, space)
    assert (found.device_bytes, found.knobs.micro_batch_size,
            step_time_s(model, training, HW, found.knobs)) == min(keys)
    assert found.n_priced <= found.n_points == len(keys)


@pytest.mark.parametrize(("d_model", "gpus"), [(256, 1), (512, 2)])
def test_a_tie_is_broken(d_model: int, gpus: int) -> None:
    """Short sequences of a wide model: several plans need the same least memory (on one GPU every
    micro-batch, at the optimizer step; on two ZeRO-2 and ZeRO-3 at one micro-batch). The smallest
    plan takes the smallest micro-batch, then the fastest of its plans."""
    model = ModelConfig(family="llama", n_layers=4, d_model=d_model, n_heads=4, d_ff=4 * d_model, vocab_size=512)
    training = TrainConfig(seq_len=8, global_batch_size=8)
    space = build_space(model, training, HW, (PrecisionPolicy.BF16_MIXED,), gpus=gpus, zero_stage=None)
    needs: dict[int, list[Knobs]] = {}
    for point in space.points():
        knobs, peak = least_memory_at(model, training, HW, space.knobs_at(training, point), None,
                                      space.allow_segments, space.checkpoint_policies)
        needs.setdefault(device_bytes(peak, HW), []).append(knobs)
    tied = needs[min(needs)]
    assert len(tied) > 1
    smallest_batch = min(k.micro_batch_size for k in tied)
    fastest = min(step_time_s(model, training, HW, k) for k in tied if k.micro_batch_size == smallest_batch)
    found = smallest_plan(model, training, HW, space)
    assert found.device_bytes == min(needs)
    assert found.knobs.micro_batch_size == smallest_batch
    assert step_time_s(model, training, HW, found.knobs) == fastest
