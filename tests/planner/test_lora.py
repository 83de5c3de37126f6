"""LoRA plans without torch: the description peft's adapters make, the refusals (one line, exit 2),
and a useful answer for Llama 3 8B on an RTX 4090 (issue 25 item 3). Memory and FLOPs against
peft under the tracker: tests/validate/test_lora_memory.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import call

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.finetune.config import FinetuneConfig
from planner.graph.blocks import describe
from planner.graph.params import count_params, count_trainable_params
from planner.model.sources import resolve
from planner.ops.base import OpKind
from planner.plan.knobs import Knobs
from roofplan.cli import main as plan_main
from roofplan.finetune_advice import finetune_advice

LLAMA3_8B, _ = resolve("llama3-8b")


def _lora(**fields: object):  # noqa: ANN202
    return LLAMA3_8B.model_copy(update={"finetune": FinetuneConfig.model_validate(fields)})


def test_llama3_8b_trainable_parameters_are_peft_s() -> None:
    """peft's print_trainable_parameters for Meta-Llama-3-8B with r 8 on q_proj and v_proj:
    "trainable params: 3,407,872 || all params: 8,033,669,120" (32 blocks x (8 x (4096 + 4096) +
    8 x (4096 + 1024))); the base's 8,030,261,248 are frozen."""
    model = _lora(rank=8, target_modules=["q_proj", "v_proj"])
    assert count_trainable_params(model) == 3_407_872
    assert count_params(model) == 8_033_669_120
    assert count_params(LLAMA3_8B) == 8_030_261_248


def test_adapters_sit_beside_each_target_and_the_base_is_frozen() -> None:
    desc = describe(_lora(rank=4, target_modules=["o_proj"], dropout=0.1))
    names = [op.name for op in desc.ops]
    at = names.index("blocks.0.attn.o_proj")
    assert names[at:at + 7] == ["blocks.0.attn.o_proj", "blocks.0.attn.o_proj.lora_cast",
                                "blocks.0.attn.o_proj.lora_dropout.default", "blocks.0.attn.o_proj.lora_A.default",
                                "blocks.0.attn.o_proj.lora_B.default", "blocks.0.attn.o_proj.lora_scale",
                                "blocks.0.attn.o_proj.lora_add"]
    residual = next(op for op in desc.ops if op.name == "blocks.0.attn_residual")
    assert "blocks.0.attn.o_proj.lora_add" in residual.inputs  # the add's output replaces the base's
    trained = {name for name, p in desc.params.items() if not p.frozen}
    assert trained == {f"blocks.{b}.attn.o_proj.lora_{x}.default.weight" for b in range(32) for x in "AB"}
    assert sum(op.kind is OpKind.SCALE for op in desc.ops) == 32


def test_all_linear_leaves_the_lm_head_out() -> None:
    desc = describe(_lora(target_modules=["all-linear"]))
    adapted = {op.name.rsplit(".lora_A", 1)[0] for op in desc.ops if ".lora_A" in op.name}
    assert len(adapted) == 32 * 7 and "lm_head" not in adapted


@pytest.mark.parametrize(("fields", "needles"), [
    ({"target_modules": ["qproj"]}, ("finetune.target_modules", "'qproj'", "q_proj, k_proj, v_proj")),
    ({"method": "qlora"}, ("finetune.method", "qlora", "bf16-true")),
])
def test_bad_finetune_is_one_line(fields: dict[str, object], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as error:
        describe(_lora(**fields))
    assert "\n" not in str(error.value)
    assert all(n in str(error.value) for n in needles), str(error.value)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--finetune", "lora", "--lora-targets", "nope_proj"], "finetune.target_modules: 'nope_proj' names no linear"),
    (["--finetune", "qlora"], "finetune.method: qlora is not priced"),
    (["--finetune", "dora"], "--finetune: 'dora' is not a method"),
    (["--lora-rank", "4"], "--lora-rank: applies to a fine-tuning plan"),
    (["--finetune", "lora", "--lora-rank", "0"], "--lora-rank:"),
    (["--finetune", "lora", "--gpus", "2"], "--gpus: a fine-tuning plan"),
])
def test_cli_refusals_exit_2_in_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = call(plan_main, ["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32",
                                      "--checkpoint", "none", *argv], capsys)
    assert code == 2, (code, err)
    assert "Traceback" not in err and len(err.strip().split("\n")) == 1 and needle in err, err


def test_model_file_section(tmp_path: Path) -> None:
    path = tmp_path / "lora.yaml"
    path.write_text("model: llama3-8b\nfinetune: {method: lora, rank: 16, target_modules: [q_proj, k_proj]}\n")
    model, _ = resolve(path)
    assert model.finetune == FinetuneConfig(rank=16, target_modules=("q_proj", "k_proj"))


def test_llama3_8b_lora_on_an_rtx_4090(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25: ``plan --model llama3-8b --hardware rtx-4090 --finetune lora`` answers usefully.
    Its bf16 base with 2,048-token sequences and every block checkpointed fits the 24 GiB card; the
    fp32 base of the same plan does not, and the advice prices the bf16 base (measured, not guessed)."""
    code, out, err = call(plan_main, ["--model", "llama3-8b", "--hardware", "rtx-4090", "--finetune", "lora",
                                      "--precision", "bf16-true", "--seq-len", "2048", "--global-batch", "8",
                                      "--micro-batch", "1", "--checkpoint", "all", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["model"]["n_trainable_params"] == 3_407_872
    memory = result["best"]["estimate"]["memory"]
    assert memory["fits"] and memory["grads_bytes"] < 8 * 2**20  # bf16 grads of 3.4M adapters
    assert memory["params_bytes"] == pytest.approx(2 * 8_033_669_120, rel=1e-3)  # the frozen base in bf16
    hw = load_hardware("rtx-4090")
    training = resolve("llama3-8b", seq_len=2048, global_batch_size=8)[1]
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, precision="bf16-mixed", checkpoint_blocks=tuple(range(32)))
    advice = finetune_advice(_lora(), training, hw, hw.hbm_bytes, knobs)
    assert advice is not None and "--precision bf16-true" in advice and "fits" in advice


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
def test_search_bounds_stay_below_the_walk(precision: str) -> None:
    """The graph-free bounds the search prunes with count no gradient nor optimizer state for the
    frozen base (a full model's state would prune LoRA plans that fit)."""
    from planner.program.estimate import estimate, peak_lower_bound
    from search.bounds import static_floor_at, step_floor_bound

    tiny, training = resolve("tiny-llama")
    model = tiny.model_copy(update={"finetune": FinetuneConfig(target_modules=("all-linear",))})
    hw = load_hardware("h100-sxm")
    for micro, blocks in ((training.global_batch_size, ()), (1, (0,))):
        knobs = Knobs(micro_batch_size=micro, grad_accum_steps=training.global_batch_size // micro,
                      precision=precision, checkpoint_blocks=blocks)
        peak = estimate(model, training, hw, knobs).memory.peak_allocated_bytes
        assert peak_lower_bound(model, training, hw, knobs) <= peak
        assert step_floor_bound(model, training, hw, knobs) <= static_floor_at(model, training, hw, knobs) <= peak
        full = step_floor_bound(tiny, training, hw, knobs)
        assert step_floor_bound(model, training, hw, knobs) < full  # the frozen base's state is gone
