"""Plans that checkpoint some blocks whole and others per op (or their attention core only):
the two-policy placement solver against every placement walked in full, a mixed plan's peak and
FLOPs against PyTorch, and the search against exhaustive enumeration of every mixed placement."""

from __future__ import annotations

import itertools

import pytest

from hardware.registry import load_hardware
from planner.memory.placement import placement_profile
from planner.memory.placement_mixed import MixedProfile
from planner.memory.step import checkpoint_units, simulate_step
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.checkpointing import CheckpointPolicy
from planner.plan.knobs import Knobs
from planner.precision import precision_spec
from planner.program.estimate import estimate, rank_graph, static_for
from search.candidates import evaluate

HW = load_hardware("h100-sxm")
LLAMA = ModelConfig(family="llama", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=704, vocab_size=2048,
                    max_seq_len=1024)
GPT = ModelConfig(family="gpt2", n_layers=4, d_model=256, n_heads=4, d_ff=1024, vocab_size=2048, max_seq_len=1024,
                  attention="eager", dropout=0.1)
TRAINING = TrainConfig(seq_len=512, global_batch_size=4)
FULL, ATTENTION, OPS = CheckpointPolicy.FULL, CheckpointPolicy.ATTENTION, CheckpointPolicy.OPS


def _mixed_knobs(base: Knobs, pair: tuple[CheckpointPolicy, CheckpointPolicy], statuses: tuple[int, ...]) -> Knobs:
    return base.model_copy(update={
        "checkpoint_blocks": tuple(i for i, s in enumerate(statuses) if s), "checkpoint_policy": pair[0],
        "block_policies": tuple((i, pair[1]) for i, s in enumerate(statuses) if s == 2)})


@pytest.mark.parametrize(("model", "precision", "pair"), [
    (LLAMA, "bf16-mixed", (FULL, OPS)), (LLAMA, "fp32", (FULL, OPS)), (GPT, "bf16-mixed", (FULL, ATTENTION)),
    (GPT, "fp32", (ATTENTION, OPS)),
], ids=["llama-bf16-full-ops", "llama-fp32-full-ops", "gpt-bf16-full-attention", "gpt-fp32-attention-ops"])
def test_the_solver_equals_every_placement_walked(model: ModelConfig, precision: str,
                                                  pair: tuple[CheckpointPolicy, CheckpointPolicy]) -> None:
    """Every one of the 3^L placements: the solver's peak equals the full walk's; for every pair
    of counts its lowest peak equals the lowest walked, and the placement it gives reaches it."""
    base = Knobs(micro_batch_size=2, grad_accum_steps=2, precision=precision)
    graph = rank_graph(model, TRAINING, base, precision_spec(precision), HW)
    static = static_for(graph, HW, TRAINING, base)
    n = model.n_layers
    mixed = MixedProfile(*(placement_profile(graph, static, HW.round_alloc, base.schedule, None, p) for p in pair))
    lowest: dict[tuple[int, int], int] = {}
    for statuses in itertools.product((0, 1, 2), repeat=n):
        knobs = _mixed_knobs(base, pair, statuses)
        units = checkpoint_units(n, knobs.checkpoint_blocks, (), knobs.checkpoint_policy, knobs.save_list,
                                 knobs.policy_overrides)
        peak = simulate_step(graph, static, HW.round_alloc, units, base.schedule).peak.bytes
        assert mixed.peak(statuses) == peak, statuses
        counts = (statuses.count(1), statuses.count(2))
        lowest[counts] = min(lowest.get(counts, peak), peak)
    best, choices = mixed.min_peak_by_counts()
    for (a, b), peak in lowest.items():
        assert best[a][b] == peak, (a, b)
        assert mixed.peak(mixed.placement(choices, a, b)) == peak
    bounded, bounded_choices = mixed.min_peak_by_counts(2, 1)  # counts only grow: the bounds are exact
    for a, b in itertools.product(range(3), range(2)):
        assert bounded[a][b] == best[a][b]
        assert mixed.peak(mixed.placement(bounded_choices, a, b)) == best[a][b]


# (model, precision, checkpoint_policy, blocks, other policies per block): against PyTorch
CASES = [
    (LLAMA, "bf16-mixed", FULL, (0, 1, 2, 3), ((1, OPS), (3, OPS))),
    (LLAMA, "fp32", OPS, (1, 2, 3), ((2, FULL),)),
    (GPT, "fp32", FULL, (0, 1, 2, 3), ((1, ATTENTION), (2, OPS))),
]


@pytest.mark.parametrize(("model", "precision", "policy", "blocks", "others"), CASES,
                         ids=["llama-bf16-full+ops", "llama-fp32-ops+full", "gpt-fp32-three-policies"])
def test_a_mixed_plan_matches_pytorch(model: ModelConfig, precision: str, policy: CheckpointPolicy,
                                      blocks: tuple[int, ...], others: tuple[tuple[int, CheckpointPolicy], ...]) -> None:
    """validate runs each block under its own policy: the planner's peak within 1% of the
    live-storage tracker, the step's FLOPs (recompute included) equal to FlopCounterMode's."""
    pytest.importorskip("torch")
    from validate.simulate import simulate_step as run_in_pytorch

    knobs = Knobs(micro_batch_size=2, grad_accum_steps=2, precision=precision, checkpoint_blocks=blocks,
                  checkpoint_policy=policy, block_policies=others)
    predicted = estimate(model, TRAINING, HW, knobs)
    measured = run_in_pytorch(model, TRAINING, knobs)
    assert predicted.memory.peak_allocated_bytes == pytest.approx(measured.peak_allocated_bytes, rel=0.01)
    assert predicted.hardware_flops_per_step == pytest.approx(measured.flops_per_step, rel=1e-9)


def test_the_search_finds_the_fastest_placement_of_all() -> None:
    """For caps across the whole range, the search point's plan is as fast as the fastest of all
    3^L placements (each priced by ``estimate``) that fits, and its figures are that plan's."""
    model = LLAMA.model_copy(update={"n_layers": 5})
    training = TrainConfig(seq_len=1024, global_batch_size=8)
    base = Knobs(micro_batch_size=4, grad_accum_steps=2, precision="bf16-mixed")
    priced = []
    for statuses in itertools.product((0, 1, 2), repeat=model.n_layers):
        est = estimate(model, training, HW, _mixed_knobs(base, (FULL, OPS), statuses))
        priced.append((est.step_time_s, est.memory.device_bytes))
    sizes = sorted({b for _, b in priced})
    mixed_won = 0
    for cap in sizes[:: max(1, len(sizes) // 12)]:
        fastest = min(t for t, b in priced if b <= cap)
        ev = evaluate(model, training, HW, cap, base, allow_segments=False, policies=(FULL, OPS))
        assert ev.fits and ev.chosen.step_time_s == pytest.approx(fastest, rel=1e-9), cap
        check = estimate(model, training, HW, ev.knobs)
        assert (check.step_time_s, check.memory.device_bytes) == (pytest.approx(ev.chosen.step_time_s, rel=1e-9),
                                                                  ev.chosen.device_bytes)
        mixed_won += bool(ev.knobs.block_policies)
        alone = evaluate(model, training, HW, cap, base, allow_segments=False, policies=(FULL, OPS),
                         mix_policies=False)
        assert alone.chosen.step_time_s >= ev.chosen.step_time_s
    assert mixed_won  # some cap is best met by a mix


def test_block_policies_name_checkpointed_blocks_once() -> None:
    with pytest.raises(ValueError, match="block_policies: name each block once"):
        Knobs(micro_batch_size=1, checkpoint_blocks=(0, 1), block_policies=((2, OPS),))
    with pytest.raises(ValueError, match="block_policies: name each block once"):
        Knobs(micro_batch_size=1, checkpoint_blocks=(0, 1), block_policies=((1, OPS), (1, ATTENTION)))


def test_the_configuration_row_counts_each_policy() -> None:
    from roofplan.render import _checkpoint_how

    knobs = Knobs(micro_batch_size=1, checkpoint_blocks=(0, 1, 2), block_policies=((1, OPS), (2, OPS)))
    assert _checkpoint_how(knobs) == ": 1 whole, 2 per op keeping " + knobs.save_list.label


def test_transformers_runs_one_policy() -> None:
    from planner.errors import ConfigError
    from validate.hf_model import checkpoint_every

    knobs = Knobs(micro_batch_size=1, checkpoint_blocks=(0, 1), block_policies=((1, OPS),))
    with pytest.raises(ConfigError, match="transformers checkpoints whole decoder layers"):
        checkpoint_every(knobs, 2)
