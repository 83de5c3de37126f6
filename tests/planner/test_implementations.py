"""The implementation setting: torchtitan 0.3.0 against its reproduction, the model file and its
one-line refusals, Liger's chunking, and the commands.

torchtitan cannot be a test dependency (it needs triton to import, and pulls in wandb,
tensorboard, datasets); ``tests/planner/torchtitan_llama3.py`` reproduces its Llama 3 step op for
op (equal to the byte to the real torchtitan 0.3.0 where it is installed:
``test_reproduction_equals_torchtitan``, skipped here otherwise). Required: within 2% of it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torchtitan_llama3 as titan  # noqa: E402  (tests/planner: a test helper)

from hardware.registry import load_hardware  # noqa: E402
from planner.errors import ConfigError  # noqa: E402
from planner.graph.blocks import describe  # noqa: E402
from planner.model.config import ModelConfig, TrainConfig, effective_activation, effective_loss  # noqa: E402  # noqa: E402
from planner.model.sources import resolve  # noqa: E402
from planner.ops.impl_losses import liger_chunk_rows  # noqa: E402
from planner.plan.knobs import Knobs  # noqa: E402
from planner.program.estimate import estimate  # noqa: E402
from validate.tracker import LiveStorageTracker  # noqa: E402

HW = load_hardware("h100-sxm")
SHAPE = dict(n_layers=2, d_model=256, n_heads=8, n_kv_heads=2, d_ff=688, vocab_size=2048)
SEQ = 256


def titan_model(**changes: Any) -> ModelConfig:
    return ModelConfig.model_validate({"family": "llama", "implementation": "torchtitan", "max_seq_len": SEQ,
                                       "rope_theta": 500000.0, **SHAPE, **changes})


def titan_peak(batch: int, accumulation: int, dtype: Any, checkpoint: bool, seq: int = SEQ) -> int:
    """The reproduction's steady-state step under fake tensors and the tracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    s = SHAPE
    with FakeTensorMode():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = titan.Llama3(s["n_layers"], s["d_model"], s["n_heads"], s["n_kv_heads"], s["d_ff"],
                                 s["vocab_size"], seq, checkpoint=checkpoint)
        finally:
            torch.set_default_dtype(previous)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        rows = batch * accumulation
        tokens, labels = (torch.randint(0, s["vocab_size"], (rows, seq)) for _ in range(2))
        positions = torch.arange(seq).expand(rows, seq).contiguous()
        tracker = LiveStorageTracker()
        tracker.track([*model.parameters(), *model.buffers(), tokens, labels, positions])
        with tracker:
            titan.train_step(model, optimizer, tokens, labels, positions, batch, accumulation)
            tracker.reset_peak()
            titan.train_step(model, optimizer, tokens, labels, positions, batch, accumulation)
        return tracker.peak_bytes


def titan_predicted(batch: int, accumulation: int, precision: str, checkpoint: bool, **changes: Any) -> int:
    model = titan_model(**changes)
    training = TrainConfig(seq_len=SEQ, global_batch_size=batch * accumulation)
    knobs = Knobs(micro_batch_size=batch, grad_accum_steps=accumulation, precision=precision,
                  checkpoint_blocks=tuple(range(model.n_layers)) if checkpoint else ())
    return estimate(model, training, HW, knobs).memory.peak_allocated_bytes


# (micro-batch, precision, every block checkpointed); torchtitan trains without accumulation by
# default. Measured when written: -0.03%, -0.05%, -0.31%, -0.16%, -0.09% (the last two peak in the
# optimizer step, after the RoPE buffers the walk frees at the last rotary backward).
TITAN_CASES = [(2, "fp32", False), (2, "bf16-true", False), (1, "bf16-true", True), (2, "fp32", True),
               (4, "bf16-true", True)]


@pytest.mark.parametrize(("batch", "precision", "checkpoint"), TITAN_CASES)
def test_torchtitan_peak_within_two_percent(batch: int, precision: str, checkpoint: bool) -> None:
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    measured = titan_peak(batch, 1, dtype, checkpoint)
    assert titan_predicted(batch, 1, precision, checkpoint) == pytest.approx(measured, rel=0.02)
    if not checkpoint:  # the reference pricing does not get there (plain loss: the whole logits)
        reference = titan_predicted(batch, 1, precision, checkpoint, implementation="reference")
        assert abs(reference / measured - 1) > 0.02


def test_torchtitan_accumulation_reads_one_head_gradient_over() -> None:
    """With accumulation the chunked loss reads over by the LM head's gradient: the first chunk
    allocates it in the forward, which the walk (gradients allocated at backward) can only price
    for the first micro-batch (README, Limitations)."""
    measured = titan_peak(2, 2, torch.float32, False)
    predicted = titan_predicted(2, 2, "fp32", False)
    head_grad = SHAPE["vocab_size"] * SHAPE["d_model"] * 4
    assert predicted - measured == pytest.approx(head_grad, rel=0.02)


def test_reproduction_equals_torchtitan() -> None:
    """Where torchtitan 0.3.0 imports (it needs triton): its Llama3Model with SDPA as inner
    attention and ``nn.RMSNorm`` run as on CUDA, its ChunkedLossWrapper, equal to the byte."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")
    from torchtitan_real import real_peak  # pragma: no cover - needs torchtitan

    for batch, dtype, checkpoint in ((2, torch.float32, False), (1, torch.bfloat16, True)):  # pragma: no cover
        assert real_peak(SHAPE, SEQ, batch, 1, dtype, checkpoint) == titan_peak(batch, 1, dtype, checkpoint)


def test_model_file_and_refusals() -> None:
    model, training = resolve({"model": {"preset": "tiny-gpt2", "implementation": "hf"},
                               "training": {"seq_len": 128, "global_batch_size": 2}})
    assert effective_activation(model).value == "gelu_new"  # GPT2Config's default
    assert effective_loss(titan_model()).value == "chunked"
    for section, field in (({"preset": "tiny-gpt2", "implementation": "torchtitan"}, "implementation"),
                           ({"preset": "tiny-llama", "activation": "gelu_new"}, "activation"),
                           ({"preset": "tiny-llama", "loss_chunks": 4}, "loss_chunks"),
                           ({"preset": "tiny-llama", "implementation": "jax"}, "implementation")):
        with pytest.raises(ConfigError) as error:
            resolve({"model": section, "training": {"seq_len": 128, "global_batch_size": 2}})
        assert field in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="loss_chunks") as error:
        resolve({"model": {"preset": "tiny-llama", "implementation": "torchtitan"}}, seq_len=100, global_batch_size=2)
    assert "\n" not in str(error.value)


def test_reference_description_is_untouched() -> None:
    """The reference with the plain loss is the reference description, op for op."""
    model, _ = resolve("tiny-llama", seq_len=128, global_batch_size=2)
    assert model.implementation.value == "reference"
    assert all(op.field("variant") is None for op in describe(model).ops)
    hf = describe(model.model_copy(update={"implementation": "hf"}))
    assert [op.name for op in hf.ops] == [op.name for op in describe(model).ops]


def test_liger_chunks_and_fused_loss_drops_the_logits() -> None:
    """Liger-Kernel 0.8.5's own example: BT = 4096 * 4, V = 32000, H = 4096 -> inc_factor 8,
    chunk_size 2048. Priced with the fused linear loss, a 128k-vocabulary model's peak falls by
    about the logits the plain loss keeps (three (B, T, V) fp32 at the start of backward)."""
    assert liger_chunk_rows(4096 * 4, 4096, 32000) == 2048
    assert liger_chunk_rows(100, 4096, 32000) == 16
    base = ModelConfig(family="llama", n_layers=2, d_model=512, n_heads=8, d_ff=1376, vocab_size=128256,
                       max_seq_len=2048)
    training = TrainConfig(seq_len=2048, global_batch_size=1)
    knobs = Knobs(micro_batch_size=1, precision="bf16-true")
    plain = estimate(base, training, HW, knobs).memory.peak_allocated_bytes
    fused = estimate(ModelConfig.model_validate({**base.model_dump(), "loss": "fused-linear"}), training, HW,
                     knobs).memory.peak_allocated_bytes
    logits = 2048 * 128256 * 4
    assert plain - fused > 2 * logits
    chunked = estimate(ModelConfig.model_validate({**base.model_dump(), "loss": "chunked"}), training, HW,
                       knobs).memory.peak_allocated_bytes
    assert fused < chunked < plain


def test_plan_command_carries_the_implementation(tmp_path: Any) -> None:
    from roofplan.cli import main

    out = tmp_path / "plan.json"
    assert main(["--model", "tiny-llama", "--implementation", "torchtitan", "--seq-len", "128", "--global-batch",
                 "2", "--micro-batch", "2", "--precision", "bf16-true", "--checkpoint", "none", "--out",
                 str(out), "--json"]) == 0
    config = json.loads(out.read_text())["model"]["config"]
    assert config["implementation"] == "torchtitan"
    assert math.isfinite(json.loads(out.read_text())["best"]["estimate"]["step_time_s"])


def test_validate_runs_transformers_for_a_plan(tmp_path: Any, capsys: Any) -> None:
    """``validate --implementation hf`` on a reference plan: transformers' model, priced for it."""
    pytest.importorskip("transformers")
    from roofplan.cli import main as plan_main
    from roofplan.validate_cli import main as validate_main

    out = tmp_path / "plan.json"
    assert plan_main(["--model", "tiny-llama", "--seq-len", "128", "--global-batch", "2", "--micro-batch", "2",
                      "--precision", "bf16-true", "--checkpoint", "all", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    assert validate_main([str(out), "--mode", "simulate", "--implementation", "hf", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "pass" and abs(report["errors"]["peak_allocated"]) < 0.01
    assert any("transformers" in note for note in report["notes"])
    assert plan_main(["--model", "tiny-llama", "--seq-len", "128", "--global-batch", "2", "--micro-batch", "2",
                      "--precision", "bf16-true", "--checkpoint", "1", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    assert validate_main([str(out), "--mode", "simulate", "--implementation", "hf"]) == 2
    assert "every_n_layers" in capsys.readouterr().err
