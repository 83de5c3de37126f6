"""The optuna search: the default sampler finds what exhaustive enumeration finds; it is
deterministic for a seed; infeasible requests say what would fit."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hardware.registry import load_hardware
from planner.errors import InfeasibleError
from planner.model.config import ModelConfig, TrainConfig
from roofplan import api

PROFILES = ("h100-sxm", "a100-sxm-40gb", "l4", "h200")


def _best_time(model: ModelConfig, training: TrainConfig, hardware: str, hbm: int | None, sampler: str) -> float | None:
    try:
        result = api.plan(model, training, hardware, hbm, sampler=sampler)
    except InfeasibleError:
        return None
    assert result.best.estimate.memory.fits
    return result.best.estimate.step_time_s


@st.composite
def small_requests(draw: st.DrawFn) -> tuple[ModelConfig, TrainConfig, str, int]:
    family = draw(st.sampled_from(["llama", "gpt2", "qwen2", "mistral"]))
    heads = draw(st.sampled_from([2, 4]))
    model = ModelConfig(
        family=family,
        n_layers=draw(st.integers(2, 6)),
        d_model=draw(st.sampled_from([64, 128])),
        n_heads=heads,
        n_kv_heads=None if family == "gpt2" else draw(st.sampled_from([1, heads])),
        d_ff=draw(st.sampled_from([128, 256, 344])),
        vocab_size=draw(st.sampled_from([256, 4096, 32000])),
        max_seq_len=512,
        attention=draw(st.sampled_from(["flash", "eager"])),
    )
    training = TrainConfig(seq_len=draw(st.sampled_from([64, 256, 512])),
                           global_batch_size=draw(st.sampled_from([4, 6, 8, 12, 16])))
    hardware = draw(st.sampled_from(PROFILES))
    # a cap between "almost nothing fits" and "everything fits" for this request
    smallest = api.estimate_plan(model, training, hardware, api.Knobs(
        micro_batch_size=1, grad_accum_steps=training.global_batch_size, precision="bf16-true",
        checkpoint_blocks=range(model.n_layers))).best.estimate.memory.device_bytes
    largest = api.estimate_plan(model, training, hardware, api.Knobs(
        micro_batch_size=training.global_batch_size, precision="bf16-mixed")).best.estimate.memory.device_bytes
    cap = draw(st.integers(int(smallest * 0.98), max(int(smallest * 0.98) + 1, int(largest * 1.02))))
    return model, training, hardware, cap


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_requests())
def test_default_sampler_matches_exhaustive(request: tuple[ModelConfig, TrainConfig, str, int]) -> None:
    model, training, hardware, cap = request
    exhaustive = _best_time(model, training, hardware, cap, "exhaustive")
    default = _best_time(model, training, hardware, cap, "tpe")
    if exhaustive is None:
        assert default is None
    else:
        assert default == pytest.approx(exhaustive, rel=1e-12)


@pytest.mark.parametrize("hardware", ["a100-sxm-80gb", "h100-sxm", "l40s"])
@pytest.mark.parametrize("preset", ["gpt2", "gpt2-xl", "llama2-7b", "mistral-7b"])
def test_presets_default_matches_exhaustive(preset: str, hardware: str) -> None:
    model, training = api.load_model(preset, global_batch_size=32)
    exhaustive = _best_time(model, training, hardware, None, "exhaustive")
    default = _best_time(model, training, hardware, None, "tpe")
    assert (exhaustive is None) == (default is None)
    if exhaustive is not None:
        assert default == pytest.approx(exhaustive, rel=1e-12)


def test_same_seed_same_result() -> None:
    model, training = api.load_model("tiny-llama", global_batch_size=16)
    runs = [api.plan(model, training, "h100-sxm", "1.2GB", sampler=s, seed=7).model_dump(mode="json")
            for s in ("tpe", "tpe", "random", "random")]
    for run in runs:
        run["search"]["wall_s"] = 0.0
    assert runs[0] == runs[1]
    assert runs[2] == runs[3]


def test_infeasible_says_what_would_fit() -> None:
    model, training = api.load_model("llama3-8b")
    with pytest.raises(InfeasibleError) as error:
        api.plan(model, training, "h100-sxm", "80GB")
    message = str(error.value)
    assert "the smallest plan needs" in message
    for part in ("params", "grads", "optimizer", "b200", "--gpus "):
        assert part in message
    assert "to fit: a cap" not in message  # it needs more than an H100 has: no cap would do
    with pytest.raises(InfeasibleError) as error:
        api.plan(model, training, "b200", "80GB")
    assert "to fit: a cap of at least" in str(error.value)  # a B200 has it: a higher cap would do
    assert error.value.exit_code == 1


def test_fixed_knobs_are_respected() -> None:
    model, training = api.load_model("tiny-gpt2", global_batch_size=8)
    result = api.plan(model, training, "l4", precisions=["bf16-true"], micro_batch_size=4)
    assert result.best.knobs.micro_batch_size == 4
    assert result.best.knobs.precision.value == "bf16-true"
    fixed = api.plan(model, training, "l4", checkpoint="all")
    assert fixed.best.knobs.checkpoint_blocks == tuple(range(model.n_layers))


def test_segments_fit_where_per_block_checkpointing_cannot() -> None:
    """Chen et al.'s segments keep one input per segment: with a cap just below what per-block
    checkpointing of every block needs, only a segmented plan fits."""
    model, training = api.load_model("llama2-7b", global_batch_size=64)
    hw = load_hardware("b200")
    every = api.estimate_plan(model, training, hw, api.Knobs(
        micro_batch_size=8, grad_accum_steps=8, precision="bf16-mixed", checkpoint_blocks=range(32)))
    cap = every.best.estimate.memory.device_bytes - 1
    result = api.plan(model, training, hw, cap, precisions=["bf16-mixed"], micro_batch_size=8)
    assert result.best.knobs.checkpoint_segments
    assert result.best.estimate.memory.fits
    with pytest.raises(InfeasibleError):
        api.plan(model, training, hw, cap, precisions=["bf16-mixed"], micro_batch_size=8, allow_segments=False)


@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(["llama", "gpt2"]),
    n_layers=st.integers(1, 4),
    vocab=st.sampled_from([100, 5000, 50000]),
    attention=st.sampled_from(["flash", "eager"]),
    micro=st.sampled_from([1, 2, 4]),
    precision=st.sampled_from(["fp32", "bf16-true", "bf16-mixed"]),
    optimizer=st.sampled_from(["adamw", "sgd", "sgd-momentum"]),
    impl=st.sampled_from(["foreach", "fused"]),
    blocks=st.sets(st.integers(0, 3)),
    parallel=st.sampled_from([(1, 0), (2, 0), (4, 1), (2, 2), (4, 3), (64, 3)]),
)
def test_pruning_bound_never_exceeds_the_peak(family: str, n_layers: int, vocab: int, attention: str, micro: int,
                                              precision: str, optimizer: str, impl: str, blocks: set[int],
                                              parallel: tuple[int, int]) -> None:
    """The search skips points whose lower bound exceeds the cap: the bound must hold for
    every placement, or a plan that fits could be skipped."""
    from planner.program.estimate import estimate, peak_lower_bound

    model = ModelConfig(family=family, n_layers=n_layers, d_model=64, n_heads=2, d_ff=256, vocab_size=vocab,
                        max_seq_len=256, attention=attention)
    gpus, stage = parallel
    training = TrainConfig(seq_len=128, global_batch_size=4 * gpus, optimizer=optimizer, optimizer_impl=impl)
    knobs = api.Knobs(micro_batch_size=micro, grad_accum_steps=4 // micro, precision=precision,
                      checkpoint_blocks=[b for b in blocks if b < n_layers], data_parallel=gpus, zero_stage=stage)
    hw = load_hardware("h100-sxm")
    assert peak_lower_bound(model, training, hw, knobs) <= estimate(model, training, hw, knobs).memory.peak_allocated_bytes
