"""Expert parallelism as a searched dimension: which degrees the space offers, which points are
plans, the search against exhaustive enumeration, the flag's refusals, and the report."""

from __future__ import annotations

import json

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from roofplan import api
from roofplan.cli import main as plan_main
from search.space import EP, ZERO_STAGE, build_space, layout_refusal

HW = load_hardware("h100-sxm")
MOE = ModelConfig(family="mixtral", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=4096,
                  max_seq_len=512, moe=dict(n_experts=8, top_k=2, d_ff_expert=512))
DENSE = ModelConfig(family="llama", n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=4096, max_seq_len=512)
TRAINING = TrainConfig(seq_len=512, global_batch_size=16)


def test_the_space_offers_degrees_dividing_the_experts_and_the_gpus() -> None:
    space = build_space(MOE, TRAINING, HW, gpus=8, tensor_parallel=1, context_parallel=1, expert_parallel=None)
    assert space.expert_parallel == (1, 2, 4, 8)
    six = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"n_experts": 6})})
    assert build_space(six, TRAINING, HW, gpus=8, tensor_parallel=1, context_parallel=1,
                       expert_parallel=None).expert_parallel == (1, 2)
    assert EP not in build_space(DENSE, TRAINING, HW, gpus=8, tensor_parallel=1, context_parallel=1,
                                 expert_parallel=None).dimensions


def test_expert_parallel_points_run_under_fsdp2_over_ranks_they_divide() -> None:
    space = build_space(MOE, TRAINING, HW, gpus=8, tensor_parallel=None, context_parallel=1, expert_parallel=None)
    points = list(space.points())
    with_ep = [p for p in points if int(p[EP]) > 1]
    assert with_ep, "no expert-parallel plan offered"
    for point in with_ep:
        dims = space.layout(point)
        assert int(point[ZERO_STAGE]) >= 2 and dims.dp_shard % dims.ep == 0 and dims.cp == 1
    assert {int(p[EP]) for p in points} == {1, 2, 4, 8}
    assert not any(int(p[EP]) > 1 and int(p[ZERO_STAGE]) < 2 for p in points)
    # 16 sequences on 8 GPUs: ZeRO-2/3 over 8 ranks take every degree; DDP and ZeRO-1 only ep 1
    assert {(int(p[ZERO_STAGE]), int(p[EP])) for p in points} == {(0, 1), (1, 1)} | {
        (stage, ep) for stage in (2, 3) for ep in (1, 2, 4, 8)}


def test_the_default_search_equals_exhaustive_enumeration_over_ep() -> None:
    cap = int(1.2e9)
    exhaustive = api.plan(MOE, TRAINING, "h100-sxm", cap, gpus=8, sampler="exhaustive")
    default = api.plan(MOE, TRAINING, "h100-sxm", cap, gpus=8, n_trials=10)
    assert default.best.estimate.step_time_s == pytest.approx(exhaustive.best.estimate.step_time_s, rel=1e-12)
    space = build_space(MOE, TRAINING, HW, gpus=8, tensor_parallel=None, context_parallel=None, expert_parallel=None)
    assert exhaustive.search.n_evaluated == len(list(space.points()))


def test_a_fixed_ep_is_priced_with_its_all_to_alls() -> None:
    plans = {ep: api.plan(MOE, TRAINING, "h100-sxm", int(80e9), gpus=8, zero_stage=3, tp=1, cp=1, ep=ep,
                          micro_batch_size=2, precisions=["bf16-mixed"], checkpoint="none") for ep in (1, 4)}
    one, four = (plans[ep].best.estimate for ep in (1, 4))
    assert plans[4].best.knobs.parallel.ep == 4
    assert one.time.expert_parallel_s == 0 and four.time.expert_parallel_s > 0
    # the same FLOPs: expert parallelism moves rows, not work
    assert four.model_flops_per_step == pytest.approx(one.model_flops_per_step, rel=1e-12)


@pytest.mark.parametrize(("model", "args", "says"), [
    (MOE, ["--gpus", "8", "--ep", "3"], "--ep: 3 must be a positive divisor of the 8 GPUs"),
    (MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"n_experts": 6})}), ["--gpus", "8", "--ep", "4"],
     "--ep: 4 does not divide the 6 experts"),
    (DENSE, ["--gpus", "8", "--ep", "2"], "has no mixture-of-experts blocks"),
    (MOE, ["--ep", "2"], "--ep: 2 needs several GPUs"),
    (MOE, ["--gpus", "8", "--ep", "2", "--zero-stage", "1"], "--ep: expert parallelism splits FSDP2's"),
])
def test_bad_ep_is_one_line_naming_the_flag(tmp_path, capsys, model: ModelConfig, args: list[str],
                                            says: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"model": model.model_dump(mode="json"), "training": TRAINING.model_dump(mode="json")}))
    code = plan_main(["--model", str(path), "--hbm", "80GB", *args])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_the_report_shows_the_expert_layout_and_its_time(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # table cells unwrapped
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"model": MOE.model_dump(mode="json"), "training": TRAINING.model_dump(mode="json")}))
    code = plan_main(["--model", str(path), "--hbm", "80GB", "--gpus", "8", "--zero-stage", "3", "--tp", "1",
                      "--cp", "1", "--ep", "4", "--micro-batch", "2", "--precision", "bf16-mixed", "--checkpoint",
                      "none"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "EP 4" in out and "2 of the 8 experts" in out and "expert-parallel all-to-alls" in out


def test_ep_without_moe_refused_in_the_api() -> None:
    with pytest.raises(ConfigError, match="--ep"):
        api.plan(DENSE, TRAINING, "h100-sxm", int(80e9), gpus=8, ep=2)


def test_tensor_parallel_layouts_of_moe_models_are_offered() -> None:
    """Tensor parallelism of MoE blocks is modelled (``planner.parallel.tensor_moe``): the space
    offers tp > 1 on a MoE model, alone and with ep over the data-parallel ranks it leaves, and
    leaves it out where the blocks cannot run it (the load-balancing loss)."""
    space = build_space(MOE, TRAINING, HW, gpus=8, tensor_parallel=None, context_parallel=1, expert_parallel=None)
    layouts = {(space.layout(p).tp, space.layout(p).ep) for p in space.points()}
    assert {(2, 1), (2, 2), (2, 4)} <= layouts and (2, 8) not in layouts
    aux = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"aux_loss_coef": 0.01})})
    assert (layout_refusal(aux, TRAINING.seq_len, 2, 1) or "").startswith("moe.aux_loss_coef: under tensor parallelism")
    assert build_space(aux, TRAINING, HW, gpus=8, tensor_parallel=None, context_parallel=1,
                       expert_parallel=None).tensor_parallel == (1,)
