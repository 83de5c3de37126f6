"""A minimal model file, as a new user writes it: rotary models need no max_seq_len, a context
beyond a rotary model's max_seq_len is a one-line warning, and every bad field is named at once."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from planner.errors import ConfigError, ConfigWarning
from planner.model.config import ModelConfig
from roofplan import api
from roofplan.cli import main as plan_main

MINIMAL = """\
model:
  family: llama
  n_layers: 2
  d_model: 64
  n_heads: 4
  d_ff: 128
  vocab_size: 1000
training:
  seq_len: 96
  global_batch_size: 8
"""


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "model.yaml"
    path.write_text(text)
    return str(path)


def test_a_rotary_model_needs_no_max_seq_len(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, MINIMAL)
    model, training = api.load_model(path)
    assert model.max_seq_len == training.seq_len == 96
    code = plan_main(["--model", path, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    assert json.loads(out)["model"]["config"]["max_seq_len"] == 96
    assert api.load_model(path, seq_len=200)[0].max_seq_len == 200  # --seq-len too, without a warning


def test_learned_positions_still_need_it(tmp_path: Path) -> None:
    text = MINIMAL.replace("family: llama", "family: gpt2")
    with pytest.raises(ConfigError, match="max_seq_len: required with learned positions"):
        api.load_model(_write(tmp_path, text))


def test_a_context_beyond_a_rotary_max_seq_len_warns_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_main(["--model", "tiny-llama", "--seq-len", "4096", "--global-batch", "4", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    json.loads(out)  # stdout stays JSON
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan: warning: training.seq_len 4096 is beyond model.max_seq_len")
    with pytest.warns(ConfigWarning, match="beyond model.max_seq_len"):
        api.load_model("tiny-llama", seq_len=4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.load_model("tiny-llama")  # within it: silent


def test_learned_positions_beyond_the_table_are_still_refused() -> None:
    with pytest.raises(ConfigError, match="learned position table"):
        api.load_model("tiny-gpt2", seq_len=10**6)


def test_every_wrong_field_is_named_in_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = MINIMAL.replace("n_layers: 2", "n_layers: 0").replace("d_ff: 128", "d_ff: -1").replace(
        "vocab_size: 1000", "vocab_size: 1000\n  colour: red")
    code = plan_main(["--model", _write(tmp_path, text)])
    _, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for field in ("model.n_layers", "model.d_ff", "model.colour"):
        assert field in lines[0], field
    assert "more problem" not in lines[0]


def test_checks_between_fields_are_named_with_the_bad_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """d_model not divisible by n_heads, n_heads by n_kv_heads and a negative d_ff: all three in the
    one line (pydantic runs no check between fields while a field fails)."""
    text = MINIMAL.replace("d_model: 64", "d_model: 65").replace("n_heads: 4", "n_heads: 4\n  n_kv_heads: 3").replace(
        "d_ff: 128", "d_ff: -1")
    code = plan_main(["--model", _write(tmp_path, text)])
    _, err = capsys.readouterr()
    assert code == 2
    line, = err.strip().splitlines()
    for what in ("model.d_ff", "d_model (65) must be divisible by n_heads (4)", "n_heads (4) must be divisible by n_kv_heads (3)"):
        assert what in line, what
    with pytest.raises(ValueError) as error:  # in Python too: both checks between fields at once
        ModelConfig(family="llama", n_layers=2, d_model=65, n_heads=4, n_kv_heads=3, d_ff=128, vocab_size=1000)
    assert "n_kv_heads (3)" in str(error.value) and "d_model (65)" in str(error.value)


def test_a_config_built_in_python_keeps_working_without_max_seq_len() -> None:
    model = ModelConfig(family="llama", n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=1000)
    _, training = api.load_model(model, seq_len=64, global_batch_size=8)
    result = api.plan(*api.load_model(model, seq_len=64, global_batch_size=8))
    assert result.model.config.max_seq_len == training.seq_len
