"""The search on several GPUs: ZeRO stage as a searched knob, default sampler vs exhaustive,
fixed stages, fewest-GPU advice, and the flags."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.errors import ConfigError, InfeasibleError
from planner.model.config import ModelConfig, TrainConfig
from roofplan import api
from roofplan.cli import main as plan_main


def _best(model: ModelConfig, training: TrainConfig, hw: str, cap: int, gpus: int, sampler: str,
          n_trials: int = 30) -> float | None:
    try:
        result = api.plan(model, training, hw, cap, gpus=gpus, sampler=sampler, n_trials=n_trials)
    except InfeasibleError:
        return None
    assert result.best.estimate.memory.fits and result.best.knobs.parallel.world_size == gpus
    return result.best.estimate.step_time_s


# derandomized: CI sees the same examples on every run (a search that misses is a real failure)
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "gpt2"]),
    n_layers=st.integers(2, 5),
    gpus=st.sampled_from([2, 4, 8, 16]),
    per_gpu=st.sampled_from([1, 2, 4]),
    cap_gb=st.floats(1.1, 1.4),
    n_trials=st.sampled_from([5, 10, 30]),
)
def test_default_sampler_matches_exhaustive_on_several_gpus(family: str, n_layers: int, gpus: int, per_gpu: int,
                                                            cap_gb: float, n_trials: int) -> None:
    """The default search equals exhaustive enumeration, whether its budget covers the space
    (30 trials: priced whole) or not (5, 10: TPE, then the polish from the leaders)."""
    model = ModelConfig(family=family, n_layers=n_layers, d_model=256, n_heads=4, d_ff=1024, vocab_size=32000,
                        max_seq_len=512)
    training = TrainConfig(seq_len=512, global_batch_size=gpus * per_gpu)
    cap = int(cap_gb * 1e9)
    exhaustive = _best(model, training, "h100-sxm", cap, gpus, "exhaustive")
    default = _best(model, training, "h100-sxm", cap, gpus, "tpe", n_trials)
    assert (exhaustive is None) == (default is None)
    if exhaustive is not None:
        assert default == pytest.approx(exhaustive, rel=1e-12)


def test_a_budget_that_covers_the_space_prices_every_plan() -> None:
    """8 GPUs, 16 sequences: 22 plans (micro-batch x ZeRO stage x tp) within 30 trials, each priced once."""
    from hardware.registry import load_hardware
    from search.space import build_space

    model = ModelConfig(family="llama", n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=32000,
                        max_seq_len=512)
    training = TrainConfig(seq_len=512, global_batch_size=16)
    plans = list(build_space(model, training, load_hardware("h100-sxm"), gpus=8, tensor_parallel=None).points())
    assert len(plans) == 22
    result = api.plan(model, training, "h100-sxm", int(1.3e9), gpus=8, n_trials=30)
    assert result.search.n_evaluated == result.search.n_trials == len(plans)


def test_the_polish_repairs_a_coupled_layout() -> None:
    """From (micro-batch 4, tp 4, ZeRO-2) on 8 GPUs and 8 sequences, tp 1 needs micro-batch 1 (a
    rank's share is one sequence): the neighbour with tp 1 is that repaired plan, not no plan."""
    from hardware.registry import load_hardware
    from search.space import build_space

    model = ModelConfig(family="llama", n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=32000,
                        max_seq_len=512)
    training = TrainConfig(seq_len=512, global_batch_size=8)
    space = build_space(model, training, load_hardware("h100-sxm"), gpus=8, tensor_parallel=None)
    point = space.point(micro_batch_size=4, precision="bf16-mixed", zero_stage=2, tp=4)
    neighbours = space.neighbours(point)
    assert {"micro_batch_size": 1, "precision": "bf16-mixed", "zero_stage": 2, "tp": 1} in neighbours
    assert all(space.allows(n) for n in neighbours)


def test_searched_stage_is_the_fastest_fixed_stage() -> None:
    """ZeRO stage as a knob: DDP does not fit 7B on 16 x 80 GB here, every sharded stage does,
    and the search returns the fastest of the four stages searched one by one (tp 1 throughout, a
    quarter of the space; no pipeline: with two stages DDP fits too, tests/search/test_pipeline_search.py)."""
    model, training = api.load_model("llama2-7b", global_batch_size=64)
    fixed: dict[int, float] = {}
    for stage in (0, 1, 2, 3):
        try:
            fixed[stage] = api.plan(model, training, "h100-sxm", "80GB", gpus=16, precisions=["bf16-mixed"],
                                    zero_stage=stage, pp=1, tp=1).best.estimate.step_time_s
        except InfeasibleError:
            continue
    assert sorted(fixed) == [1, 2, 3]
    result = api.plan(model, training, "h100-sxm", "80GB", gpus=16, precisions=["bf16-mixed"], pp=1, tp=1)
    fastest = min(fixed, key=lambda s: fixed[s])
    assert result.best.knobs.zero_stage == fastest
    assert result.best.estimate.step_time_s == pytest.approx(fixed[fastest], rel=1e-12)


def test_infeasible_names_the_fewest_gpus() -> None:
    model, training = api.load_model("llama2-7b", global_batch_size=64)
    with pytest.raises(InfeasibleError) as error:
        api.plan(model, training, "h100-sxm", "80GB", precisions=["bf16-mixed"])
    message = str(error.value)
    assert "it fits on 2 GPUs as ZeRO-2 (FSDP2) × 2" in message and "--gpus 2 --zero-stage 2" in message
    fits = api.plan(model, training, "h100-sxm", "80GB", precisions=["bf16-mixed"], gpus=2, zero_stage=2)
    assert fits.best.estimate.memory.fits
    with pytest.raises(InfeasibleError):  # the least sharding that fits: ZeRO-1 does not on 2 GPUs
        api.plan(model, training, "h100-sxm", "80GB", precisions=["bf16-mixed"], gpus=2, zero_stage=1)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"gpus": 3}, "--gpus"),
        ({"gpus": 0}, "--gpus"),
        ({"zero_stage": 1}, "--zero-stage"),
        ({"gpus": 2, "zero_stage": 5}, "--zero-stage"),
        ({"gpus": 2, "zero_stage": 3, "precisions": ["fp16-mixed"]}, "--precision"),
        ({"gpus": 2, "gpus_per_node": 0}, "--gpus-per-node"),
        ({"gpus": 2, "micro_batch_size": 16}, "--micro-batch"),  # 8 (4 per rank, or 8 per TP pair) has no 16
    ],
)
def test_bad_multi_gpu_requests(kwargs: dict, needle: str) -> None:
    model, training = api.load_model("tiny-llama")  # global batch 8
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        api.plan(model, training, **kwargs)


def test_cli_flags_and_plan_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    out = tmp_path / "plan.json"
    code = plan_main(["--model", "tiny-llama", "--gpus", "4", "--gpus-per-node", "2", "--out", str(out), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["best"]["knobs"]["data_parallel"] == 4
    assert data["parallel"] == {"world_size": 4, "gpus_per_node": 2}
    assert data["best"]["knobs"]["micro_batch_size"] * data["best"]["knobs"]["grad_accum_steps"] == 2
    assert json.loads(out.read_text())["parallel"]["world_size"] == 4
    assert plan_main(["--model", "tiny-llama", "--gpus", "3"]) == 2
    assert "--gpus" in capsys.readouterr().err
    from roofplan.validate_cli import main as validate_main

    assert validate_main([str(out), "--mode", "simulate"]) == 0  # one rank emulated in this process
    assert "PASS" in capsys.readouterr().out
    assert validate_main([str(out), "--mode", "run", "--device", "cpu"]) == 2  # needs torchrun
    assert "torchrun --nproc-per-node 4" in capsys.readouterr().err


def test_cli_gradient_sync_on_the_last_micro_batch(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """--fsdp-grad-sync last reaches the plan file, the search keeps it on its ZeRO-2/3 points, and
    the plan it writes validates (FSDP2 on a fake process group, held gradients included)."""
    out = tmp_path / "plan.json"
    code = plan_main(["--model", "tiny-llama", "--gpus", "2", "--zero-stage", "3", "--global-batch", "8",
                      "--micro-batch", "1", "--fsdp-grad-sync", "last", "--out", str(out), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    knobs = data["best"]["knobs"]
    assert knobs["fsdp_grad_sync"] == "last" and knobs["grad_accum_steps"] == 4
    from roofplan.validate_cli import main as validate_main

    assert validate_main([str(out), "--mode", "simulate"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_scale_out_advice_keeps_the_gradient_sync_mode() -> None:
    """With --fsdp-grad-sync last the fewest-GPU advice is priced in that mode, at ZeRO-2/3 only."""
    model, training = api.load_model("tiny-llama", global_batch_size=16)
    smallest = api.plan(model, training, "h100-sxm", gpus=2, zero_stage=3, precisions=["fp32"], micro_batch_size=1,
                        checkpoint="all", fsdp_grad_sync="last")
    cap = smallest.best.estimate.memory.device_bytes - 1  # nothing fits on 2 GPUs any more
    with pytest.raises(api.InfeasibleError) as caught:
        api.plan(model, training, "h100-sxm", hbm=cap, gpus=2, zero_stage=3, precisions=["fp32"],
                 fsdp_grad_sync="LAST")
    message = str(caught.value)
    assert "--fsdp-grad-sync last" in message and ("--zero-stage 2" in message or "--zero-stage 3" in message)
