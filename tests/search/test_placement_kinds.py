"""The exact placement solver for blocks of several kinds against brute force over every subset.

DeepSeek-V3's dense first blocks before MoE blocks, gpt-oss's alternating sliding and full
attention, and an MoE block every second block (Qwen2-MoE's decoder_sparse_step 2) give blocks
that differ, which ``planner.memory.placement`` refuses; ``planner.memory.placement_kinds`` measures per-block
terms with five walks. For each configuration every one of the 2^L placements is walked: the
decomposed peak must equal the walk for every subset, and the dynamic program's lowest peak for
each count k must equal the brute-force minimum, reached by the placement it returns.
"""

from __future__ import annotations

import itertools

import pytest

from hardware.registry import load_hardware
from planner.memory.placement import NotDecomposableError, PlacementProfile
from planner.memory.placement_kinds import KindsProfile, block_kinds, exact_profile, kinds_profile
from planner.memory.step import checkpoint_units, simulate_step
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.program.estimate import check_knobs, rank_graph, static_for

HW = load_hardware("h100-sxm")
_MOE = {"n_experts": 4, "top_k": 2, "d_ff_expert": 64}
_GPT_OSS_MOE = {"n_experts": 4, "top_k": 2, "d_ff_expert": 48, "expert_bias": True, "router_bias": True,
                "norm_topk_prob": False, "expert_activation": "clamped-swiglu", "scoring": "topk-softmax"}
_MLA = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
_ROUTER = {"scoring": "sigmoid", "score_correction_bias": True, "n_group": 2, "topk_group": 1,
           "routed_scaling_factor": 2.5}


def _windows(n: int) -> tuple[str, ...]:
    return tuple(("sliding_attention", "full_attention")[i % 2] for i in range(n))


def _model(kind: str, n: int, vocab: int = 256, first_dense: int = 0) -> ModelConfig:
    base = {"n_layers": n, "d_model": 64, "n_heads": 4, "vocab_size": vocab}
    if kind == "dense-prefix":
        return ModelConfig(family="mixtral", **base, n_kv_heads=2, d_ff=128, moe={**_MOE, "first_dense_layers": 3})
    if kind == "moe-every-2":
        return ModelConfig(family="qwen2_moe", **base, n_kv_heads=2, d_ff=128, moe={**_MOE, "every": 2})
    if kind == "deepseek-mla":
        return ModelConfig(family="deepseek_v3", **base, d_ff=128, mla=_MLA,
                           moe={**_MOE, "d_ff_expert": 32, "shared_d_ff": 64, "first_dense_layers": 3, **_ROUTER})
    return ModelConfig(family="gpt_oss", **base, n_kv_heads=2, attention_head_dim=24, d_ff=48, attention="eager",
                       sliding_window=16, layer_types=_windows(n),
                       moe={**_GPT_OSS_MOE, "first_dense_layers": first_dense})


def _setup(model: ModelConfig, precision: str = "bf16-mixed", accum: int = 2, gpus: int = 1, stage: int = 0,
           ep: int = 1, policy: str = "full", sync: str = "every"):  # noqa: ANN202
    training = TrainConfig(seq_len=64, global_batch_size=2 * accum * gpus, optimizer_impl="fused")
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accum, precision=precision, checkpoint_policy=policy,
                  parallel=ParallelDims.data_parallel_of(gpus, stage, ep=ep), fsdp_grad_sync=sync)
    graph = rank_graph(model, training, knobs, check_knobs(model, training, HW, knobs), HW)
    return graph, static_for(graph, HW, training, knobs), knobs


def _walk(graph, static, knobs: Knobs, blocks: tuple[int, ...], trace: bool = False):  # noqa: ANN001, ANN202
    units = checkpoint_units(graph.model.n_layers, blocks, (), knobs.checkpoint_policy, knobs.save_list)
    return simulate_step(graph, static, HW.round_alloc, units, knobs.schedule, record_trace=trace)


CASES = [
    # kind, blocks, large vocabulary (peak at the loss), setup
    pytest.param("dense-prefix", 8, False, {}, id="dense-prefix-8-autocast"),
    pytest.param("dense-prefix", 7, True, {"precision": "fp32", "accum": 1, "gpus": 4, "stage": 3, "ep": 2},
                 id="dense-prefix-7-fp32-zero3-ep2-big-vocab"),
    pytest.param("moe-every-2", 7, False, {"precision": "bf16-true", "accum": 3}, id="moe-every-2-7-bf16-true"),
    pytest.param("moe-every-2", 8, True, {"gpus": 2, "stage": 2}, id="moe-every-2-8-zero2-big-vocab"),
    pytest.param("alternating-windows", 8, False, {}, id="windows-8-autocast"),
    pytest.param("alternating-windows", 7, False, {"precision": "fp32", "gpus": 4, "stage": 1, "policy": "ops"},
                 id="windows-7-zero1-per-op"),
    pytest.param("deepseek-mla", 7, False, {"accum": 3, "gpus": 4, "stage": 3, "sync": "last"},
                 id="deepseek-7-zero3-sync-last"),
]


@pytest.mark.parametrize(("kind", "n_layers", "big_vocab", "setup"), CASES)
def test_kinds_solver_equals_brute_force(kind: str, n_layers: int, big_vocab: bool, setup: dict) -> None:
    graph, static, knobs = _setup(_model(kind, n_layers, 20000 if big_vocab else 256), **setup)
    assert len(set(block_kinds(graph))) == 2
    profile = exact_profile(graph, static, HW.round_alloc, knobs.schedule, None, knobs.checkpoint_policy,
                            knobs.save_list)
    assert isinstance(profile, KindsProfile)
    walked = {bits: _walk(graph, static, knobs, tuple(i for i, b in enumerate(bits) if b)).peak.bytes
              for bits in itertools.product((0, 1), repeat=n_layers)}
    wrong = [bits for bits, peak in walked.items() if profile.peak(bits) != peak]
    assert not wrong, f"{len(wrong)} of {len(walked)} placements priced differently from the walk, e.g. {wrong[0]}"
    for k, (peak, placement) in enumerate(profile.min_peak_by_count()):
        assert peak == min(p for bits, p in walked.items() if sum(bits) == k)
        assert sum(placement) == k and walked[placement] == peak


def test_alike_blocks_keep_the_three_walk_profile() -> None:
    """Blocks of one kind are still solved by ``planner.memory.placement`` (three walks, not five)."""
    model = ModelConfig(family="llama", n_layers=6, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256)
    graph, static, knobs = _setup(model)
    assert isinstance(exact_profile(graph, static, HW.round_alloc, knobs.schedule), PlacementProfile)


def test_walks_that_do_not_decompose_are_refused() -> None:
    """The guard has teeth: a walk passed as "every block checkpointed" that is not, or more kinds
    of block than the outside events can tell apart, are refused rather than mispriced."""
    graph, static, knobs = _setup(_model("dense-prefix", 8))
    wrong = _walk(graph, static, knobs, (0, 2, 4, 6), trace=True)
    with pytest.raises(NotDecomposableError):
        kinds_profile(graph, static, HW.round_alloc, knobs.schedule, all_checkpointed=wrong)
    four, static, knobs = _setup(_model("alternating-windows", 8, first_dense=2))
    assert len(set(block_kinds(four))) == 4
    with pytest.raises(NotDecomposableError, match="kinds"):
        kinds_profile(four, static, HW.round_alloc, knobs.schedule)
