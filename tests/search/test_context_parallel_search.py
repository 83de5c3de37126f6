"""Context parallelism in the search and on the command line: a searched dimension equal to
exhaustive enumeration, --cp fixing it, the report's rows and the fewest-GPU advice naming it."""

from __future__ import annotations

import json

import pytest

from hardware.registry import load_hardware
from planner.config import ModelConfig, TrainConfig
from planner.errors import ConfigError, InfeasibleError
from roofplan import api
from roofplan.cli import main as plan_main
from search.space import CP, MIN_CONTEXT_SHARD_TOKENS, build_space, layout_degrees

HW = load_hardware("h100-sxm")
# long sequences on a small model: context parallelism is a real choice, and pricing is fast
LONG = ModelConfig(family="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=352, vocab_size=4096,
                   max_seq_len=32768)


def test_the_searched_degrees_leave_each_rank_a_long_enough_shard() -> None:
    training = TrainConfig(seq_len=16384, global_batch_size=8)
    tps, cps = layout_degrees(LONG, training, 8, 8, None, None, True)
    assert cps == tuple(cp for cp in (1, 2, 4) if 16384 // cp >= MIN_CONTEXT_SHARD_TOKENS)
    assert tps == (1, 2)  # 2 key/value heads: tp 4 and 8 are refused
    space = build_space(LONG, training, HW, gpus=8, tensor_parallel=None, context_parallel=None)
    assert space.dimensions[CP] == cps
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
    (["--cp", "2", "--zero-stage", "0"], "ZeRO-1 and DDP need one GPU per tensor-parallel group or none and no "
                                         "context parallelism"),
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
    with pytest.raises(ConfigError, match="--tp x --cp: 4 x 4 must divide the 8 GPUs"):
        api.plan(LONG, training, HW, gpus=8, tp=4, cp=4, zero_stage=3, micro_batch_size=1, precisions=["bf16-mixed"],
                 checkpoint="none")
