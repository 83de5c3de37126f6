"""Hostile inputs to the command lines (issue 21): files that are not text or not files, Ctrl-C,
sizes beyond any real model, and flags that disagree. Each gets one line and exit 2 (130 for
Ctrl-C), never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import call

from hardware.files import MAX_INPUT_BYTES, MAX_NESTING
from hardware.registry import load_hardware
from roofplan.cli import main as plan_main
from roofplan.hardware_cli import main as hardware_main
from roofplan.validate_cli import main as validate_main

REPO = Path(__file__).resolve().parent.parent
FIXED = ["--micro-batch", "2", "--precision", "fp32", "--checkpoint", "none"]


def one_line_error(code: int, out: str, err: str, prog: str, *needles: str) -> str:
    assert code == 2, (code, err)
    assert "Traceback" not in err + out
    assert out == ""
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


# --------------------------------------------------------------------------------------------
# item 4: files that are binary, too large, or not regular files


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("model:\n  name: caf\xe9\n".encode("latin-1"))
    large = tmp_path / "large.yaml"
    large.write_bytes(b"# " + b"x" * MAX_INPUT_BYTES + b"\n")
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.yaml"  # crashed libyaml (segmentation fault) before the nesting check
    deep.write_text("model: " + "[" * 100_000 + "]" * 100_000)
    bomb = tmp_path / "bomb.yaml"
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    bomb.write_text("\n".join(lines) + "\n")
    return {
        "binary": (binary, "binary"),
        "latin-1": (latin, "not UTF-8"),
        "too large": (large, f"{MAX_INPUT_BYTES // 2**20} MiB"),
        "directory": (directory, "a directory"),
        "fifo": (fifo, "named pipe"),
        "/dev/zero": (Path("/dev/zero"), "a device"),
        "deep nesting": (deep, f"deeper than {MAX_NESTING}"),
        "alias bomb": (bomb, "values"),
    }


BAD_FILES = ["binary", "latin-1", "too large", "directory", "fifo", "/dev/zero", "deep nesting", "alias bomb"]


@pytest.mark.parametrize("case", BAD_FILES)
def test_plan_model_bad_file(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, needle = _bad_files(tmp_path)[case]
    code, out, err = call(plan_main, ["--model", str(path), *FIXED], capsys)
    one_line_error(code, out, err, "plan", str(path), needle)


@pytest.mark.parametrize("case", BAD_FILES)
def test_plan_hardware_bad_file(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, needle = _bad_files(tmp_path)[case]
    code, out, err = call(plan_main, ["--model", "tiny-llama", "--hardware", str(path), *FIXED], capsys)
    one_line_error(code, out, err, "plan", str(path), needle)


@pytest.mark.parametrize("case", ["binary", "too large", "directory", "fifo", "/dev/zero"])
def test_validate_bad_plan_file(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, needle = _bad_files(tmp_path)[case]
    code, out, err = call(validate_main, [str(path)], capsys)
    one_line_error(code, out, err, "validate", "plan file", needle)


@pytest.mark.parametrize("case", ["binary", "/dev/zero", "fifo"])
def test_hardware_show_bad_file(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, needle = _bad_files(tmp_path)[case]
    code, out, err = call(hardware_main, ["show", str(path)], capsys)
    one_line_error(code, out, err, "hardware", needle)


def test_model_binary_file_subprocess(tmp_path: Path) -> None:
    path, _ = _bad_files(tmp_path)["binary"]
    for argv in (["plan", "--model", str(path)], ["validate", str(path)], ["plan", "--model", "/dev/zero"]):
        done = subprocess.run([sys.executable, "-m", "roofplan", *argv], capture_output=True, text=True, cwd=REPO,
                              timeout=120, check=False)
        one_line_error(done.returncode, done.stdout, done.stderr, argv[0], "cannot read it")


def test_a_readable_file_still_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The limits leave real files alone: a profile of the bundled size, a model file with a BOM-free
    UTF-8 name."""
    profile = load_hardware("h100-sxm").model_dump(mode="json")
    profile["name"] = "my-h100"
    hw = tmp_path / "my.yaml"
    hw.write_text(yaml.safe_dump(profile))
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump({"model": {"name": "café", "family": "llama", "n_layers": 2, "d_model": 128,
                                               "n_heads": 4, "d_ff": 256, "vocab_size": 100},
                                     "training": {"seq_len": 64, "global_batch_size": 8}}, allow_unicode=True))
    code, out, err = call(plan_main, ["--model", str(model), "--hardware", str(hw), *FIXED], capsys)
    assert code == 0, err
    assert "café" in out


# --------------------------------------------------------------------------------------------
# item 5: Ctrl-C


def _interrupt(*_: object, **__: object) -> None:
    raise KeyboardInterrupt


def test_plan_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from roofplan import api

    monkeypatch.setattr(api, "plan", _interrupt)
    code, out, err = call(plan_main, ["--model", "tiny-llama"], capsys)
    assert (code, out, err) == (130, "", "plan: interrupted\n")


def test_validate_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    from planner.program.results import PlanResult

    monkeypatch.setattr(PlanResult, "load", classmethod(_interrupt))
    code, out, err = call(validate_main, [str(tmp_path / "plan.json")], capsys)
    assert (code, out, err) == (130, "", "validate: interrupted\n")


def test_hardware_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import roofplan.hardware_cli as hardware_cli

    monkeypatch.setattr(hardware_cli, "_list", _interrupt)
    code, out, err = call(hardware_main, ["list"], capsys)
    assert (code, out, err) == (130, "", "hardware: interrupted\n")


def test_ctrl_c_subprocess(tmp_path: Path) -> None:
    """A real SIGINT while `plan` works: one line, exit 130, no traceback."""
    code = ("import sys, time\n"
            "from roofplan import api\n"
            "def slow(*a, **k):\n"
            "    print('working', flush=True)\n"
            "    time.sleep(60)\n"
            "api.plan = slow\n"
            "from roofplan.__main__ import main\n"
            "sys.exit(main(['plan', '--model', 'tiny-llama']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "working\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "plan: interrupted\n"
    assert out == ""


# --------------------------------------------------------------------------------------------
# item 3: sizes beyond any real model or run, from every source


def _model_yaml(tmp_path: Path, model: dict[str, Any], training: dict[str, Any] | None = None) -> str:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"model": model, "training": training or {"seq_len": 64, "global_batch_size": 8}}))
    return str(path)


TINY_MODEL = {"family": "llama", "n_layers": 2, "d_model": 128, "n_heads": 4, "d_ff": 256, "vocab_size": 100}


@pytest.mark.parametrize(("field", "value", "most"), [
    ("n_layers", 10**20, "1,024"), ("n_layers", 10**6, "1,024"), ("n_layers", 1025, "1,024"),
    ("d_model", 2**40, "131,072"), ("n_heads", 10**9, "4,096"), ("d_ff", 10**12, "1,048,576"),
    ("vocab_size", 10**10, "4,194,304"), ("max_seq_len", 10**12, "67,108,864"),
])
def test_model_size_beyond_any_model(field: str, value: int, most: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`n_layers: 1e20` ran 383 s and was killed at 23 GB; 1e6 raised SystemError, 1e5 MemoryError."""
    path = _model_yaml(tmp_path, {**TINY_MODEL, field: value})
    code, out, err = call(plan_main, ["--model", path, *FIXED], capsys)
    line = one_line_error(code, out, err, "plan", f"{field}: ", "more than any model", f"at most {most}")
    assert "published" in line  # says why the limit is where it is


def test_moe_and_mla_sizes_are_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    moe = {**TINY_MODEL, "family": "mixtral", "moe": {"n_experts": 10**7, "top_k": 2, "d_ff_expert": 64}}
    code, out, err = call(plan_main, ["--model", _model_yaml(tmp_path, moe), *FIXED], capsys)
    one_line_error(code, out, err, "plan", "moe.n_experts", "at most 16,384")


@pytest.mark.parametrize(("flags", "needles"), [
    (["--seq-len", str(10**11)], ("seq_len", "at most 67,108,864")),
    (["--global-batch", str(10**9)], ("global_batch_size", "at most 16,777,216")),
    (["--seq-len", str(2**20), "--global-batch", str(2**14)], ("seq_len x global_batch_size",)),
    (["--gpus", str(10**8)], ("--gpus", "at most 1,048,576")),
    (["--gpus-per-node", str(10**6)], ("--gpus-per-node", "at most 4,096")),
    (["--tp", str(10**8)], ("--tp",)),
    (["--trials", str(10**9)], ("--trials", "at most 100,000")),
])
def test_flag_sizes_are_bounded(flags: list[str], needles: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(plan_main, ["--model", "tiny-llama", *flags], capsys)
    one_line_error(code, out, err, "plan", *needles)


def test_micro_batch_flag_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(plan_main, ["--model", "tiny-llama", "--micro-batch", str(10**12)], capsys)
    one_line_error(code, out, err, "plan", "--micro-batch")


def test_validate_steps_bounded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = call(validate_main, [str(tmp_path / "p.json"), "--steps", str(10**9)], capsys)
    one_line_error(code, out, err, "validate", "--steps", "at most 10,000")


@pytest.mark.parametrize(("key", "value"), [("num_hidden_layers", 10**20), ("num_hidden_layers", 10**6),
                                            ("hidden_size", 2**40), ("vocab_size", 10**12)])
def test_config_json_sizes_are_bounded_and_name_the_key(key: str, value: int, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json names its own key; the reader refuses before building per-layer lists (qwen2's
    layer_types has n_layers entries)."""
    import json

    config = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 100, key: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = call(plan_main, ["--model", str(path), "--seq-len", "64", "--global-batch", "8", *FIXED], capsys)
    one_line_error(code, out, err, "plan", f"{key}: ", "more than any model")


def test_api_sources_meet_the_same_limit() -> None:
    from planner.errors import ConfigError
    from planner.model.config import ModelConfig, TrainConfig
    from planner.model.sources import load_workload

    with pytest.raises(ConfigError, match="n_layers: 1e\\+20 is more than any model"):
        load_workload({"model": {**TINY_MODEL, "n_layers": 10**20}})
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig.model_validate({**TINY_MODEL, "n_layers": 2000})
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=10**9, global_batch_size=1)


def test_sizes_at_the_limit_are_accepted() -> None:
    from planner.model.config import ModelConfig, TrainConfig
    from planner.model.limits import SIZE_LIMITS

    ModelConfig.model_validate({**TINY_MODEL, "n_layers": SIZE_LIMITS["n_layers"].most})
    TrainConfig(seq_len=SIZE_LIMITS["seq_len"].most, global_batch_size=64)


def test_presets_are_far_inside_the_limits() -> None:
    """The margin: every bundled preset uses at most a quarter of every limit."""
    from planner.model.limits import SIZE_LIMITS
    from planner.model.sources import list_presets, load_preset

    for name in list_presets():
        workload = load_preset(name)
        sections = {**workload.model.model_dump(), **(workload.training.model_dump() if workload.training else {})}
        for key, value in sections.items():
            if key in SIZE_LIMITS and isinstance(value, int) and not isinstance(value, bool):
                assert value * 4 <= SIZE_LIMITS[key].most, (name, key, value)


# --------------------------------------------------------------------------------------------
# item 14: flags that disagree, internal names, outputs


@pytest.mark.parametrize(("flags", "needles"), [
    (["--seed", "-1"], ("--seed", "0 to 4,294,967,295")),
    (["--study-name", "shared"], ("--study-name", "--storage")),
    (["--gpus", "8", "--gpus-per-node", "3"], ("--gpus", "whole nodes of 3", "6 or 9")),
    (["--gpus", "12"], ("--gpus", "whole nodes of 8")),
])
def test_flags_that_disagree(flags: list[str], needles: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(plan_main, ["--model", "tiny-llama", *flags], capsys)
    line = one_line_error(code, out, err, "plan", *needles)
    assert "--storage: cannot open" not in line


def test_config_json_messages_name_the_files_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
                                "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 100,
                                "rms_norm_eps": 0}))
    code, out, err = call(plan_main, ["--model", str(path), "--seq-len", "64", "--global-batch", "8", *FIXED], capsys)
    line = one_line_error(code, out, err, "plan", "rms_norm_eps")
    assert "norm_eps:" not in line.replace("rms_norm_eps", "")


def test_out_is_written_when_nothing_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out_file = tmp_path / "plan.json"
    code, _, err = call(plan_main, ["--model", "tiny-llama", "--hbm", "1000", "--out", str(out_file)], capsys)
    assert code == 1, err
    assert f"written to {out_file}" in err
    assert json.loads(out_file.read_text())["best"]["estimate"]["memory"]["fits"] is False


def test_piped_report_is_not_cut_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-m", "roofplan", "plan", "--model", "tiny-llama", *FIXED],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) > 80
