"""Context parallelism in the search and on the command line: a searched dimension equal to
exhaustive enumeration, --cp fixing it, the report's rows and the fewest-GPU advice naming it."""

from __future__ import annotations

import json

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError, InfeasibleError
from planner.model.config import ModelConfig, TrainConfig
from roofplan import api
from roofplan.cli import main as plan_main
from search.space import CP, MIN_CONTEXT_SHARD_TOKENS, build_space, layout_degrees

HW = load_hardware("h100-sxm")
# long sequences on a small model: context parallelism is a real choice, and pricing is fast
LONG = ModelConfig(family="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=352, vocab_size=4096,
                   max_seq_len=32768)


def test_the_searched_degrees_leave_each_rank_a_long_enough_shard() -> None:
    training = TrainConfig(seq_len=16384, global_batch_size=8)
    layouts = layout_degrees(LONG, training, 8, 8, None, None, True)
    tps, cps = sorted({tp for tp, _ in layouts}), sorted({cp for _, cp in layouts})
    assert cps == [cp for cp in (1, 2, 4) if 16384 // cp >= MIN_CONTEXT_SHARD_TOKENS]
    assert tps == [1, 2]  # 2 key/value heads: tp 4 and 8 are refused
    assert all(8 % (tp * cp) == 0 and 8 % (8 // (tp * cp)) == 0 for tp, cp in layouts)
    space = build_space(LONG, training, HW, gpus=8, tensor_parallel=None, context_parallel=None)
    assert list(space.dimensions[CP]) == cps
    assert all(space.layout(p).world_size == 8 for p in space.points())
    short = TrainConfig(seq_len=4096, global_batch_size=8)
    assert CP not in build_space(LONG, short, HW, gpus=8, tensor_parallel=None, context_parallel=None).dimensions


@pytest.mark.parametrize(("cap_gb", "n_trials"), [(0.3, 30), (0.3, 5), (0.2, 10), (0.12, 5)])
def test_the_search_with_context_parallelism_equals_exhaustive_enumeration(cap_gb: float, n_trials: int) -> None:
    """Layouts (ZeRO stage, tp, cp), micro-batch and checkpointing searched jointly: the default
    search returns the exhaustive grid's plan, whether it prices the space whole or samples it."""
    training = TrainConfig(seq_len=16384, global_batch_size=8)
    cap = int(cap_gb * 1e9)

    def best(sampler: str, trials: int) -> tuple[float, object] | None:
        try:
            result = api.plan(LONG, training, HW, cap, gpus=8, sampler=sampler, n_trials=trials)
        except InfeasibleError:
            return None
        return result.best.estimate.step_time_s, result.best.knobs.parallel

    exhaustive, default = best("exhaustive", 30), best("tpe", n_trials)
    assert (exhaustive is None) == (default is None)
    if exhaustive is not None and default is not None:
        assert default[0] == pytest.approx(exhaustive[0], rel=1e-12)


def test_cp_flag_fixes_the_degree_and_the_report_shows_it(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    model = ["--model", "llama3-8b", "--seq-len", "65536", "--global-batch", "4", "--gpus", "8"]
    assert plan_main([*model, "--cp", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["knobs"]["parallel"]["cp"] == 4
    assert plan_main([*model, "--cp", "4"]) == 0
    out = capsys.readouterr().out
    assert "CP 4" in out and "context parallel " in out and "context-parallel collectives" in out
    assert "1×16384 tokens (1/4 of each sequence)" in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--cp", "3"], "--cp: 3 must be a positive divisor of the 8 GPUs"),
    (["--cp", "2", "--zero-stage", "0"], "--cp: context parallelism runs with FSDP2 over the data- and "
                                         "context-parallel ranks; --zero-stage 0 is DDP or ZeRO-1"),
    (["--cp", "2", "--attention", "eager"], "--cp: context parallelism runs scaled_dot_product_attention"),
])
def test_bad_cp_requests_are_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_main(["--model", "llama3-8b", "--seq-len", "16384", "--global-batch", "8", "--gpus", "8", *argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("plan: warning:")]  # 16k > Llama 3's 8k
    assert code == 2
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in err


def test_the_advice_names_a_context_parallel_layout() -> None:
    """256k tokens of Llama 3 8B do not fit two H100s by data parallelism or tensor parallelism;
    the advice names the fewest GPUs and the CP degree that hold it, and that plan fits."""
    model, training = api.load_model("llama3-8b", seq_len=262144, global_batch_size=4)
    with pytest.raises(InfeasibleError) as info:
        api.plan(model, training, HW, gpus=2)
    message = str(info.value)
    assert "--cp " in message
    gpus = int(message.split("--gpus ")[1].split()[0])
    cp = int(message.split("--cp ")[1].split()[0])
    stage = int(message.split("--zero-stage ")[1].split()[0])
    fixed = api.plan(model, training, HW, gpus=gpus, cp=cp, zero_stage=stage)
    assert fixed.best.estimate.memory.fits


def test_api_refuses_a_degree_that_does_not_divide() -> None:
    training = TrainConfig(seq_len=16384, global_batch_size=8)
    with pytest.raises(ConfigError, match="--tp x --cp x --pp: 4 x 4 x 1 must divide the 8 GPUs"):
        api.plan(LONG, training, HW, gpus=8, tp=4, cp=4, zero_stage=3, micro_batch_size=1, precisions=["bf16-mixed"],
                 checkpoint="none")


def test_a_batch_smaller_than_the_data_parallel_ranks_is_not_a_plan() -> None:
    """Regression: tp and cp were combined freely, so 8 GPUs for 2 sequences of 32k tokens tried
    layouts with 8 data-parallel ranks (no whole sequence each) and crashed in Knobs."""
    model, training = api.load_model("llama3-8b", seq_len=32768, global_batch_size=2)
    space = build_space(model, training, HW, gpus=8, tensor_parallel=None, context_parallel=None)
    for point in space.points():
        assert training.global_batch_size % space.layout(point).data_parallel == 0
    assert api.plan(model, training, HW, gpus=8).best.knobs.parallel.world_size == 8


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"gpus": 1, "cp": 2}, "--cp: 2 needs several GPUs"),
    ({"gpus": 1, "tp": 2}, "--tp: 2 needs several GPUs"),
    ({"gpus": 8, "cp": 2, "zero_stage": 1}, "--cp: context parallelism runs with FSDP2"),
    ({"gpus": 8, "checkpoint_policy": "full", "save_list": "matmul"}, "--save-list: applies to --checkpoint-policy ops"),
    ({"gpus": 8, "cp": 2, "checkpoint_policy": "ops"}, "--checkpoint-policy: per-op selective checkpointing under "
                                                         "context parallelism"),
    ({"gpus": 8, "tp": 2, "cp": 2, "model": "eager"}, "--cp: context parallelism runs scaled_dot_product_attention"),
])
def test_conflicting_flags_are_one_line_naming_the_flag(kwargs: dict, needle: str) -> None:
    training = TrainConfig(seq_len=16384, global_batch_size=8)
    model = LONG.model_copy(update={"attention": "eager"}) if kwargs.pop("model", None) else LONG
    with pytest.raises(ConfigError) as info:
        api.plan(model, training, HW, int(80e9), **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_the_search_keeps_the_pareto_front_and_runners_up_of_exhaustive_enumeration() -> None:
    """Points are bounded only when dominated (slower than the best few and no smaller than the
    fastest): the best plan, the runners-up and the Pareto front are the grid's."""
    training = TrainConfig(seq_len=16384, global_batch_size=8)
    exhaustive = api.plan(LONG, training, HW, int(1.3e9), gpus=8, sampler="exhaustive")
    bounded = api.plan(LONG, training, HW, int(1.3e9), gpus=8, n_trials=30)

    def front(result: object) -> list[tuple[float, int]]:
        return sorted((round(p.step_time_s, 12), p.device_bytes) for p in result.pareto)  # type: ignore[attr-defined]

    assert bounded.best.estimate.step_time_s == pytest.approx(exhaustive.best.estimate.step_time_s, rel=1e-12)
    assert front(bounded) == front(exhaustive)
    assert [a.estimate.step_time_s for a in bounded.alternatives] == pytest.approx(
        [a.estimate.step_time_s for a in exhaustive.alternatives], rel=1e-12)
