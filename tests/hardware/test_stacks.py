"""Software stacks (hardware/stacks, issue 24): a fitted residual belongs to the stack it was fitted
on, never to a GPU profile; a stack's attention kernel and evidence reach the plan and its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hardware.errors import ConfigError
from hardware.kernels import AttentionKernel
from hardware.registry import bundled_names, load_hardware, load_profile_file
from hardware.stack import Stack, load_stack, on_stack, parse_stack

H100 = load_hardware("h100-sxm")


@pytest.mark.parametrize("stack", list(Stack))
def test_every_stack_loads_with_its_sources_and_evidence(stack: Stack) -> None:
    spec = load_stack(stack)
    assert spec.name is stack and spec.sources and len(spec.evidence) > 40
    for residual in spec.residuals:  # an own fit names the runs of this stack it was fitted on
        assert residual.hardware in bundled_names()
        assert residual.borrowed_from or "fit half" in residual.fitted_on
    if spec.residuals_borrowed_from is not None:
        assert spec.borrow_reason and not spec.residuals  # a borrowed fit is declared, with why


def test_no_profile_holds_a_fitted_residual() -> None:
    """The fit moved from the GPU profiles to the llm-foundry stack: every profile is the device's own."""
    for name in bundled_names():
        hw = load_hardware(name)
        assert hw.step_efficiency == 1.0 and hw.applied_stack is None, name
        assert not any(c.kernel is AttentionKernel.FLASH_TRITON and c.source.startswith("fitted")
                       for c in hw.attention_curves), name


def test_a_profile_file_with_a_residual_is_refused(tmp_path: Path) -> None:
    text = (Path(load_hardware.__code__.co_filename).parent / "profiles" / "h100-sxm.yaml").read_text()
    path = tmp_path / "mine.yaml"
    path.write_text(text + "step_efficiency: 0.8\n")
    with pytest.raises(ConfigError, match=r"step_efficiency: .*software stack"):
        load_profile_file(path)


def test_on_stack_lays_the_stacks_figures_over_the_device() -> None:
    foundry = on_stack(H100, Stack.LLM_FOUNDRY)
    assert foundry.step_efficiency == load_stack(Stack.LLM_FOUNDRY).residual("h100-sxm").step_efficiency
    assert foundry.attention_kernel is AttentionKernel.FLASH_TRITON
    assert len(foundry.attention_curves) == len(H100.attention_curves) + 1
    assert on_stack(H100, Stack.LLM_FOUNDRY) is foundry  # the planner's caches are keyed by identity
    assert on_stack(foundry, Stack.LLM_FOUNDRY) is foundry  # laid once
    with pytest.raises(ValueError, match="already priced"):
        on_stack(foundry, Stack.MEGATRON)
    # the default eager stack borrows llm-foundry's residual, declared; kernels: SDPA's default
    eager = on_stack(H100)
    assert eager.step_efficiency == foundry.step_efficiency and eager.attention_kernel is H100.attention_kernel
    assert "borrowed from the llm-foundry stack" in load_stack(Stack.PYTORCH).residual("h100-sxm").fitted_on
    # Transformer Engine picks cuDNN on Hopper and FlashAttention-2 on Ampere; no residual where no run was fitted
    assert on_stack(H100, Stack.MEGATRON).attention_kernel is AttentionKernel.CUDNN
    assert on_stack(load_hardware("a100-sxm-80gb"), Stack.MEGATRON).attention_kernel is AttentionKernel.FLASH2
    assert on_stack(load_hardware("b200"), Stack.TORCHTITAN).step_efficiency == 1.0


def test_a_bad_stack_name_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"--stack: 'tensorrt' is not a software stack; choose one of pytorch"):
        parse_stack("tensorrt", "--stack")


def test_the_stack_times_the_plan_and_the_report_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    """`--stack` (or training.stack in a model file) changes the step time through the stack alone:
    llm-foundry's Triton attention at its fitted rate is slower than the eager default's FlashAttention-2
    on H100 (same residual), megatron's cuDNN differs; the memory is the same; `--json` carries the stack and the
    report its rows."""
    from roofplan import api
    from roofplan.cli import main

    model, _ = api.load_model("tiny-llama")
    model = model.model_copy(update={"max_seq_len": 8192})  # long enough for attention to matter
    training = api.TrainConfig(seq_len=8192, global_batch_size=1)
    times, peaks = {}, {}
    for stack in (None, "llm-foundry", "megatron"):
        best = api.plan(model, training, "h100-sxm", micro_batch_size=1, precisions=["bf16-mixed"],
                        checkpoint="none", stack=stack).best.estimate
        times[stack], peaks[stack] = best.step_time_s, best.memory.peak_allocated_bytes
    assert times[None] < times["llm-foundry"] and times["megatron"] != times[None]
    assert len(set(peaks.values())) == 1
    from_file, trained = api.load_model({"model": "tiny-llama", "training": {"seq_len": 256, "global_batch_size": 8,
                                                                              "stack": "megatron"}})
    assert trained.stack is Stack.MEGATRON
    assert main(["--model", "tiny-llama", "--stack", "megatron", "--micro-batch", "8", "--global-batch", "8",
                 "--precision", "bf16-mixed", "--checkpoint", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["stack"] == "megatron"
    assert main(["--model", "tiny-llama", "--stack", "megatron", "--micro-batch", "8", "--global-batch", "8",
                 "--precision", "bf16-mixed", "--checkpoint", "none"]) == 0
    report = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "software stack" in report and "megatron: Megatron-Core" in report
    assert "borrowed from the llm-foundry stack" in report and "priced as eager" in report
    assert "NeMo 24.07" in report  # the stack's own evidence in "checked against"
    assert main(["--model", "tiny-llama", "--stack", "tensorrt"]) == 2
    assert "--stack: 'tensorrt' is not a software stack" in capsys.readouterr().err
