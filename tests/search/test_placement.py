"""The exact placement solver against brute force over every subset of blocks.

For each configuration, every one of the 2^L placements is walked by the memory timeline
(the ground truth, itself checked against PyTorch in tests/planner/test_memory_vs_tracker.py):
the decomposed peak must equal the walk for every subset, the dynamic program's lowest peak for
each count k must equal the brute-force minimum, and for random caps the search point's choice
must be as fast as the fastest fitting subset.
"""

from __future__ import annotations

import itertools
import random

import pytest

from hardware.registry import load_hardware
from planner.memory.placement import placement_profile
from planner.memory.step import checkpoint_units, simulate_step
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.program.estimate import cached_graph, check_knobs, device_bytes, static_for
from search.candidates import evaluate

HW = load_hardware("h100-sxm")

CASES = [
    # family, precision, attention, accumulation, blocks, vocab (a large vocab puts the peak at the
    # loss), GPUs, ZeRO stage (2/3: FSDP2, whose last block differs from the others)
    # 10 blocks, the largest case (1,024 placements): 12 blocks (4,096) cost 15 s of CPU for the same code paths
    pytest.param("llama", "bf16-mixed", "flash", 2, 10, 20000, 1, 0, "every", id="llama-10-blocks-autocast-big-vocab"),
    pytest.param("llama", "fp32", "flash", 1, 9, 500, 1, 0, "every", id="llama-9-fp32"),
    pytest.param("gpt2", "bf16-true", "eager", 2, 8, 500, 1, 0, "every", id="gpt2-8-eager-dropout"),
    pytest.param("llama", "bf16-mixed", "eager", 3, 7, 8000, 1, 0, "every", id="llama-7-eager-autocast"),
    pytest.param("qwen2", "bf16-mixed", "flash", 1, 6, 3000, 1, 0, "every", id="qwen2-6-autocast"),
    pytest.param("llama", "bf16-mixed", "flash", 2, 8, 500, 4, 3, "every", id="llama-8-fsdp-zero3-bf16-policy"),
    pytest.param("llama", "fp32", "flash", 1, 7, 8000, 2, 2, "every", id="llama-7-fsdp-zero2-fp32"),
    pytest.param("gpt2", "bf16-true", "eager", 1, 6, 500, 8, 3, "every", id="gpt2-6-fsdp-zero3-eager"),
    pytest.param("llama", "fp32", "flash", 2, 6, 500, 4, 1, "every", id="llama-6-zero1"),
    # reduce-scatter on the last micro-batch only: unsharded gradients held across micro-batches
    pytest.param("llama", "bf16-mixed", "flash", 3, 7, 500, 4, 3, "last", id="llama-7-fsdp-zero3-sync-last-upcast"),
    pytest.param("llama", "fp32", "flash", 2, 6, 8000, 2, 2, "last", id="llama-6-fsdp-zero2-sync-last"),
]
FIELDS = ("family", "precision", "attention", "accum", "n_layers", "vocab", "gpus", "stage", "sync")


def _setup(family: str, precision: str, attention: str, accum: int, n_layers: int, vocab: int,  # noqa: ANN202
           gpus: int = 1, stage: int = 0, sync: str = "every"):
    model = ModelConfig(family=family, n_layers=n_layers, d_model=128, n_heads=4, n_kv_heads=None if family == "gpt2" else 2,
                        d_ff=384, vocab_size=vocab, max_seq_len=256, attention=attention,
                        dropout=0.1 if family == "gpt2" else 0.0)
    training = TrainConfig(seq_len=128, global_batch_size=2 * accum * gpus, optimizer_impl="fused")
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accum, precision=precision, data_parallel=gpus, zero_stage=stage,
                  fsdp_grad_sync=sync)
    graph = cached_graph(model, 2, 128, check_knobs(model, training, HW, knobs))
    static = static_for(graph, HW, training, knobs)
    walked = {}
    for bits in itertools.product((0, 1), repeat=n_layers):
        units = checkpoint_units(n_layers, [i for i, b in enumerate(bits) if b])
        walked[bits] = simulate_step(graph, static, HW.round_alloc, units, knobs.schedule).peak.bytes
    return model, training, knobs, graph, static, walked


@pytest.mark.parametrize(FIELDS, CASES)
def test_solver_equals_brute_force(family: str, precision: str, attention: str, accum: int, n_layers: int, vocab: int,
                                   gpus: int, stage: int, sync: str) -> None:
    model, training, knobs, graph, static, walked = _setup(family, precision, attention, accum, n_layers, vocab,
                                                           gpus, stage, sync)
    profile = placement_profile(graph, static, HW.round_alloc, knobs.schedule)
    wrong = [bits for bits, peak in walked.items() if profile.peak(bits) != peak]
    assert not wrong, f"{len(wrong)} of {len(walked)} placements priced differently from the walk, e.g. {wrong[0]}"
    best_by_count = profile.min_peak_by_count()
    for k in range(n_layers + 1):
        brute = min(peak for bits, peak in walked.items() if sum(bits) == k)
        peak, placement = best_by_count[k]
        assert peak == brute
        assert sum(placement) == k and walked[placement] == brute

    rng = random.Random(n_layers)
    lowest = min(walked.values())
    highest = max(walked.values())
    for _ in range(6):  # random caps: the point's choice is the fastest subset that fits
        cap = device_bytes(rng.randint(lowest, highest), HW)
        fitting = [bits for bits, peak in walked.items() if device_bytes(peak, HW) <= cap]
        chosen = evaluate(model, training, HW, cap, knobs, allow_segments=False)
        if not fitting:
            assert not chosen.fits
            continue
        fewest = min(sum(bits) for bits in fitting)  # every checkpointed block adds the same recompute
        assert chosen.fits
        assert len(chosen.knobs.checkpoint_blocks) == fewest
        assert walked[tuple(1 if i in chosen.knobs.checkpoint_blocks else 0 for i in range(n_layers))] <= (
            min(walked[bits] for bits in fitting if sum(bits) == fewest)
        )


def test_early_blocks_are_cheaper_to_checkpoint() -> None:
    """The lecture's intuition made exact: with one block checkpointed, the first is the best
    choice and the last the worst (its recompute runs while all earlier activations live)."""
    *_, walked = _setup("llama", "fp32", "flash", 1, 6, 500)
    singles = {bits.index(1): peak for bits, peak in walked.items() if sum(bits) == 1}
    assert singles[0] == min(singles.values())
    assert singles[5] == max(singles.values())
    assert singles[0] < singles[5]


def _curve_setup(model: ModelConfig):  # noqa: ANN202
    from planner.program.estimate import rank_graph

    training = TrainConfig(seq_len=64, global_batch_size=2)
    knobs = Knobs(micro_batch_size=2)
    graph = rank_graph(model, training, knobs, check_knobs(model, training, HW, knobs), HW)
    static = static_for(graph, HW, training, knobs)
    n = model.n_layers
    every = simulate_step(graph, static, HW.round_alloc, checkpoint_units(n, tuple(range(n))), knobs.schedule,
                          record_trace=True)
    return training, knobs, graph, static, every


def test_blocks_of_two_kinds_beyond_brute_force_are_solved_exactly() -> None:
    """Dense first blocks before MoE blocks (DeepSeek-V3's three), more than BRUTE_FORCE_MAX_BLOCKS:
    every count gets the exact solver's placement (tests/search/test_placement_kinds.py checks it
    against brute force on fewer blocks), each priced as its own walk prices it, and never above
    the earliest blocks of that count (what the fallback walked)."""
    from search.candidates import BRUTE_FORCE_MAX_BLOCKS, _per_block_curve

    n = BRUTE_FORCE_MAX_BLOCKS + 2
    model = ModelConfig(family="mixtral", n_layers=n, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                        moe=dict(n_experts=4, top_k=2, d_ff_expert=64, first_dense_layers=3))
    training, knobs, graph, static, every = _curve_setup(model)
    curve = _per_block_curve(model, training, HW, knobs, graph, every)
    assert [sum(placement) for _, placement in curve] == list(range(n + 1))
    for k, (peak, placement) in enumerate(curve):
        units = checkpoint_units(n, [i for i in range(n) if placement[i]])
        assert peak == simulate_step(graph, static, HW.round_alloc, units, knobs.schedule).peak.bytes
        earliest = simulate_step(graph, static, HW.round_alloc, checkpoint_units(n, range(k)), knobs.schedule)
        assert peak <= earliest.peak.bytes


def test_blocks_of_many_kinds_fall_back_to_counts_of_earliest_blocks() -> None:
    """Four kinds of block (gpt-oss's alternating windows with two dense first blocks) do not
    decompose; beyond BRUTE_FORCE_MAX_BLOCKS the curve walks FALLBACK_COUNTS counts (none and
    every block included), earliest blocks first, each priced by a whole walk."""
    from search.candidates import BRUTE_FORCE_MAX_BLOCKS, FALLBACK_COUNTS, _per_block_curve

    n = BRUTE_FORCE_MAX_BLOCKS + 2
    moe = dict(n_experts=4, top_k=2, d_ff_expert=48, expert_bias=True, router_bias=True, norm_topk_prob=False,
               expert_activation="clamped-swiglu", scoring="topk-softmax", first_dense_layers=2)
    model = ModelConfig(family="gpt_oss", n_layers=n, d_model=64, n_heads=4, n_kv_heads=2, attention_head_dim=24,
                        d_ff=48, vocab_size=256, attention="eager", sliding_window=16, moe=moe,
                        layer_types=tuple(("sliding_attention", "full_attention")[i % 2] for i in range(n)))
    training, knobs, graph, static, every = _curve_setup(model)
    curve = _per_block_curve(model, training, HW, knobs, graph, every)
    counts = [sum(placement) for _, placement in curve]
    assert counts[0] == 0 and counts[-1] == n and len(counts) == FALLBACK_COUNTS
    for peak, placement in curve:
        k = sum(placement)
        assert placement == tuple(1 if i < k else 0 for i in range(n))
        units = checkpoint_units(n, [i for i in range(n) if placement[i]])
        assert peak == simulate_step(graph, static, HW.round_alloc, units, knobs.schedule).peak.bytes
