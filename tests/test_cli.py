"""The `plan` and `hardware` command lines: reports, JSON, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import call

from hardware.registry import bundled_names, load_hardware
from roofplan.cli import main as plan_main
from roofplan.hardware_cli import main as hardware_main

REPO = Path(__file__).resolve().parent.parent
FIXED = ["--micro-batch", "2", "--precision", "fp32", "--checkpoint", "none"]
TINY = ["--model", "tiny-llama", *FIXED]


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return call(plan_main, list(argv), capsys)


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, err = plan(capsys, *argv, "--json")
    assert err == ""
    return code, json.loads(out)


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert re.match(r"^(plan|hardware)( \w+)?: error: \S", lines[0]), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def run_module(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, *argv], check=False, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def model_file(tmp_path: Path, name: str = "m.yaml", **changes: Any) -> str:
    model: dict[str, Any] = {
        "family": "llama", "n_layers": 2, "d_model": 128, "n_heads": 4, "d_ff": 256, "vocab_size": 100,
        "max_seq_len": 128,
    }
    model.update(changes)
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": model, "training": {"seq_len": 64, "global_batch_size": 8}}))
    return str(path)


# --------------------------------------------------------------------------------------------
# plan: success


def test_fixed_knobs_report_fits(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    code, out, err = plan(capsys, *TINY)
    assert code == 0
    assert err == ""
    assert "FITS" in out and "DOES NOT FIT" not in out
    assert "tiny-llama" in out and "h100-sxm" in out


def test_fixed_knobs_subprocess_no_traceback() -> None:
    result = run_module("-m", "roofplan.cli", *TINY)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "FITS" in result.stdout


def test_model_file_plans(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, data = plan_json(capsys, "--model", model_file(tmp_path), *FIXED)
    assert code == 0
    assert data["model"]["config"]["n_layers"] == 2
    assert data["training"]["seq_len"] == 64


def test_json_output_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = plan_json(capsys, *TINY)
    assert code == 0
    assert data["model"]["n_params"] > 0
    knobs = data["best"]["knobs"]
    assert knobs["micro_batch_size"] == 2
    assert knobs["grad_accum_steps"] == 4  # tiny-llama's global batch 8 / micro-batch 2
    assert knobs["precision"] == "fp32"
    assert knobs["checkpoint_blocks"] == []
    est = data["best"]["estimate"]
    for key in ("step_time_s", "tokens_per_s", "mfu", "model_flops_per_step", "hardware_flops_per_step"):
        assert isinstance(est[key], float) and est[key] > 0, key
    memory = est["memory"]
    for key in ("peak_allocated_bytes", "device_bytes", "params_bytes", "grads_bytes", "optimizer_bytes",
                "activations_bytes", "logits_bytes"):
        assert isinstance(memory[key], int) and memory[key] > 0, key
    assert memory["fits"] is True
    assert memory["device_bytes"] >= memory["peak_allocated_bytes"]
    assert est["hardware_flops_per_step"] == est["model_flops_per_step"]  # nothing recomputed
    assert data["hardware"]["name"] == "h100-sxm"


@pytest.mark.parametrize(("global_batch", "micro", "accum"), [(16, 4, 4), (8, 8, 1), (6, 2, 3), (1, 1, 1)])
def test_grad_accum_is_global_over_micro(
    capsys: pytest.CaptureFixture[str], global_batch: int, micro: int, accum: int
) -> None:
    code, data = plan_json(capsys, "--model", "tiny-llama", "--global-batch", str(global_batch), "--micro-batch",
                           str(micro), "--precision", "bf16-mixed", "--checkpoint", "none")
    assert code == 0
    assert data["best"]["knobs"]["grad_accum_steps"] == accum
    assert data["training"]["global_batch_size"] == global_batch


def test_cap_too_small_prints_and_exits_1(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    code, data = plan_json(capsys, *TINY, "--hbm", "1MB")
    assert code == 1
    assert data["best"]["estimate"]["memory"]["fits"] is False
    assert data["hbm_cap_bytes"] == 10**6
    code, out, err = plan(capsys, *TINY, "--hbm", "1MB")
    assert code == 1
    assert "DOES NOT FIT" in out
    assert "Traceback" not in err


def test_hbm_cap_units(capsys: pytest.CaptureFixture[str]) -> None:
    _, si = plan_json(capsys, *TINY, "--hbm", "80GB")
    _, iec = plan_json(capsys, *TINY, "--hbm", "80GiB", "--hardware", "h200")  # 80 GiB is more than an H100 has
    assert si["hbm_cap_bytes"] == 80 * 10**9
    assert iec["hbm_cap_bytes"] == 80 * 2**30
    _, default = plan_json(capsys, *TINY)
    assert default["hbm_cap_bytes"] == load_hardware("h100-sxm").hbm_bytes


@pytest.mark.parametrize("spec", ["0,1", "all", "0-1", "1,0", " 0 - 1 "])
def test_checkpoint_every_block(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    base = ["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32"]
    code, data = plan_json(capsys, *base, "--checkpoint", spec)
    assert code == 0
    assert data["best"]["knobs"]["checkpoint_blocks"] == [0, 1]
    _, none = plan_json(capsys, *base, "--checkpoint", "none")
    est, ref = data["best"]["estimate"], none["best"]["estimate"]
    assert est["hardware_flops_per_step"] > est["model_flops_per_step"] == ref["model_flops_per_step"]
    assert est["step_time_s"] > ref["step_time_s"]
    assert est["memory"]["peak_allocated_bytes"] <= ref["memory"]["peak_allocated_bytes"]


def test_checkpoint_one_block(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = plan_json(capsys, "--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32",
                           "--checkpoint", "1")
    assert code == 0
    assert data["best"]["knobs"]["checkpoint_blocks"] == [1]


def test_other_hardware_and_precision(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = plan_json(capsys, "--model", "tiny-gpt2", "--hardware", "b200", "--micro-batch", "4",
                           "--precision", "fp8-mixed", "--checkpoint", "none")
    assert code == 0
    assert data["hardware"]["name"] == "b200"
    assert data["best"]["knobs"]["precision"] == "fp8-mixed"


def test_hardware_yaml_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    profile = load_hardware("h100-sxm").model_dump(mode="json")
    profile["name"] = "my-h100"
    path = tmp_path / "my-h100.yaml"
    path.write_text(yaml.safe_dump(profile))
    code, data = plan_json(capsys, *TINY, "--hardware", str(path))
    assert code == 0
    assert data["hardware"]["name"] == "my-h100"
    assert data["best"]["estimate"]["hardware"] == "my-h100"


# --------------------------------------------------------------------------------------------
# plan: bad input -> exit 2, one line naming the field, no traceback


def _bad_cases(tmp_path: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text("model:\n  family: llama\n  n_layers: [2\n")
    return {
        "malformed yaml": (["--model", str(malformed), *FIXED], ("malformed YAML", "line")),
        "unknown family": (["--model", model_file(tmp_path, "fam.yaml", family="bert"), *FIXED], ("model.family",)),
        "unknown preset": (["--model", "llama9-1t", *FIXED], ("llama9-1t", "tiny-llama")),
        "d_model % n_heads": (["--model", model_file(tmp_path, "div.yaml", n_heads=3), *FIXED],
                              ("d_model", "n_heads")),
        "n_heads % n_kv_heads": (["--model", model_file(tmp_path, "kv.yaml", n_kv_heads=3), *FIXED],
                                 ("n_kv_heads",)),
        "n_layers 0": (["--model", model_file(tmp_path, "zero.yaml", n_layers=0), *FIXED], ("n_layers",)),
        "d_model negative": (["--model", model_file(tmp_path, "neg.yaml", d_model=-128), *FIXED], ("d_model",)),
        "vocab 0": (["--model", model_file(tmp_path, "voc.yaml", vocab_size=0), *FIXED], ("vocab_size",)),
        "unknown model field": (["--model", model_file(tmp_path, "extra.yaml", n_layer=2), *FIXED], ("n_layer",)),
        "seq-len 0": ([*TINY, "--seq-len", "0"], ("seq_len",)),
        "seq-len > positions": (["--model", "tiny-gpt2", *FIXED, "--seq-len", "512"], ("seq_len",)),
        "micro-batch 0": (["--model", "tiny-llama", "--micro-batch", "0", "--precision", "fp32",
                           "--checkpoint", "none"], ("--micro-batch",)),
        "micro-batch negative": (["--model", "tiny-llama", "--micro-batch", "-2", "--precision", "fp32",
                                  "--checkpoint", "none"], ("--micro-batch",)),
        "micro-batch not int": (["--model", "tiny-llama", "--micro-batch", "two", "--precision", "fp32",
                                 "--checkpoint", "none"], ("--micro-batch",)),
        "global-batch -1": ([*TINY, "--global-batch", "-1"], ("global_batch_size",)),
        "micro-batch does not divide": (["--model", "tiny-llama", "--micro-batch", "3", "--precision", "fp32",
                                         "--checkpoint", "none"], ("--micro-batch", "8")),
        "fp8 on a100": (["--model", "tiny-llama", "--hardware", "a100-sxm-80gb", "--micro-batch", "2",
                         "--precision", "fp8-mixed", "--checkpoint", "none"], ("fp8", "a100-sxm-80gb")),
        "unknown precision": (["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp64",
                               "--checkpoint", "none"], ("--precision", "fp64")),
        "fp8 in a precision list on a100": (["--model", "tiny-llama", "--hardware", "a100-sxm-80gb",
                                             "--precision", "bf16-mixed,fp8-mixed"], ("fp8", "a100-sxm-80gb")),
        "hbm 80XB": ([*TINY, "--hbm", "80XB"], ("--hbm", "80XB")),
        "hbm 0": ([*TINY, "--hbm", "0"], ("--hbm",)),
        "missing model file": (["--model", "nope.yaml", *FIXED], ("nope.yaml",)),
        "checkpoint 5": (["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32",
                          "--checkpoint", "5"], ("--checkpoint", "5")),
        "checkpoint garbage": (["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32",
                                "--checkpoint", "first"], ("--checkpoint",)),
        "checkpoint reversed range": (["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32",
                                       "--checkpoint", "1-0"], ("--checkpoint",)),
        "unknown hardware": ([*TINY, "--hardware", "h100-sxm5"], ("h100-sxm5", "h100-sxm")),
        "missing hardware file": ([*TINY, "--hardware", "nope-gpu.yaml"], ("nope-gpu.yaml",)),
        "unknown attention": ([*TINY, "--attention", "sparse"], ("--attention",)),
        "dropout 1.5": ([*TINY, "--dropout", "1.5"], ("dropout",)),
        "bad sampler": ([*TINY, "--precision", "fp32,bf16-true", "--sampler", "cmaes"], ("--sampler",)),
        "zero trials": (["--model", "tiny-llama", "--trials", "0"], ("--trials",)),
        "storage without study": (["--model", "tiny-llama", "--storage", "sqlite:////tmp/x.db"], ("--study-name",)),
        "missing --model": (FIXED, ("--model",)),
    }


with tempfile.TemporaryDirectory() as _scratch:
    BAD_CASE_NAMES = sorted(_bad_cases(Path(_scratch)))


@pytest.mark.parametrize("case", BAD_CASE_NAMES)
def test_bad_input_exits_2_with_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, needles = _bad_cases(tmp_path)[case]
    code, out, err = plan(capsys, *argv)
    assert_one_line_error(code, out, err, *needles)
    assert out == ""


def test_hbm_overflow_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code, out, err = plan(capsys, *TINY, "--hbm", "1e400")
    except OverflowError:
        pytest.fail("OverflowError escaped plan's main()")
    assert_one_line_error(code, out, err, "--hbm")


@pytest.mark.parametrize("case", ["malformed yaml", "fp8 on a100", "micro-batch not int"])
def test_bad_input_subprocess_no_traceback(case: str, tmp_path: Path) -> None:
    argv, needles = _bad_cases(tmp_path)[case]
    result = run_module("-m", "roofplan.cli", *argv)
    assert_one_line_error(result.returncode, result.stdout, result.stderr, *needles)


# --------------------------------------------------------------------------------------------
# hardware


def test_hardware_list(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = call(hardware_main, ["list"], capsys)
    assert code == 0 and err == ""
    for name in bundled_names():
        assert name in out
    assert "989.4" in out  # H100 dense bf16, not 1979


def test_hardware_list_names_fit_80_columns(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = call(hardware_main, ["list"], capsys)
    assert code == 0
    for name in bundled_names():
        assert name in out


def test_hardware_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(hardware_main, ["list", "--json"], capsys)
    assert code == 0 and err == ""
    assert [p["name"] for p in json.loads(out)] == list(bundled_names())


def test_hardware_show(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    code, out, err = call(hardware_main, ["show", "h200"], capsys)
    assert code == 0 and err == ""
    assert "h200" in out
    assert "accelerator intensity" in out
    assert "https://www.nvidia.com/en-us/data-center/h200/" in out


def test_hardware_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(hardware_main, ["show", "h200", "--json"], capsys)
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data == load_hardware("h200").model_dump(mode="json")
    assert data["peak_flops_per_s"]["bf16"] == 989.4e12


@pytest.mark.parametrize(("argv", "needles"), [
    (["show", "nope"], ("nope", "h200")),
    (["show", "nope.yaml"], ("nope.yaml",)),
    (["show"], ("name",)),
    ([], ("command",)),
    (["frobnicate"], ("frobnicate",)),
])
def test_hardware_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str], needles: tuple[str, ...]) -> None:
    code, out, err = call(hardware_main, argv, capsys)
    assert_one_line_error(code, out, err, *needles)


def test_hardware_show_bad_profile_subprocess(tmp_path: Path) -> None:
    profile = load_hardware("h100-sxm").model_dump(mode="json")
    profile["memory_efficiency"] = 1.5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(profile))
    result = run_module("-m", "roofplan.hardware_cli", "show", str(path))
    assert_one_line_error(result.returncode, result.stdout, result.stderr, "memory_efficiency")


@pytest.mark.parametrize(("hardware", "needle"), [
    ("a100-sxm-80gb", "its residual is llm-foundry's, borrowed"),  # the default eager stack's evidence
    ("l40s", "no published run checked against this profile"),
])
def test_time_table_says_what_the_step_time_was_checked_against(capsys: pytest.CaptureFixture[str], hardware: str,
                                                                needle: str) -> None:
    code, out, _ = plan(capsys, *TINY, "--hardware", hardware)
    assert code == 0
    assert "checked against" in out
    assert needle in " ".join(out.replace("│", " ").split())


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path) -> None:
    """``plan ... | head -1``: the command ends quietly (status 141, as under SIGPIPE)."""
    command = f"{sys.executable} -m roofplan plan --model tiny-llama --out {tmp_path / 'p.json'} | head -c 1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120,
                          check=False, cwd=REPO)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode in (0, 141)
