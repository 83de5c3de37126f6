"""Issue 21 item 15: the README's reference parts say what the code does: every bundled preset is
listed, the ``--json`` schema names every key ``plan --json`` writes, and what ``validate``
compares on several GPUs (memory, not FLOPs) is what it reports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from roofplan import api
from roofplan.cli import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(title)
    end = README.index("\n## ", start + len(title))
    return README[start:end]


def test_every_preset_is_listed() -> None:
    presets = README[README.index("Presets ("):README.index("Hardware: `a100")]
    listed = set(re.findall(r"`([a-z0-9.\-]+)`", presets))
    bundled = {p.stem for p in (ROOT / "planner" / "model" / "presets").glob("*.yaml")}
    assert bundled - listed == set(), "presets missing from the README"
    assert listed - bundled <= {"planner/model/presets/"}, "README lists presets that do not exist"


def _keys(value: Any, path: str = "") -> set[tuple[str, str]]:
    """(path, key) of every key in a --json document, past the fields the schema names as a whole."""
    whole = {"hardware", "model.config", "best.estimate.hardware"}
    out: set[tuple[str, str]] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            out.add((path, key))
            child = f"{path}.{key}" if path else key
            if child not in whole:
                out |= _keys(item, child)
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        out |= _keys(value[0], path)
    return out


def _plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert plan_main([*argv, "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_the_json_schema_names_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    schema = README[README.index("### `--json`"):README.index("## Validate: run the plan")]
    searched = _plan_json(["--model", "tiny-llama", "--gpus", "4", "--tp", "2", "--global-batch", "8",
                           "--trials", "3"], capsys)
    piped = _plan_json(["--model", "tiny-llama", "--gpus", "2", "--pp", "2", "--micro-batch", "1",
                        "--precision", "bf16-mixed", "--checkpoint", "none", "--global-batch", "4"], capsys)
    assert piped["best"]["estimate"]["stages"], "the pipeline plan has its stages"
    missing = sorted(f"{path}.{key}" for path, key in _keys(searched) | _keys(piped)
                     if f'"{key}"' not in schema)
    assert not missing, f"--json keys the README's schema does not name: {missing}"


def test_validate_on_several_gpus_compares_memory_not_flops() -> None:
    pytest.importorskip("torch")
    model, training = api.load_model("tiny-llama", global_batch_size=4)
    plan = api.plan(model, training, gpus=2, zero_stage=3, micro_batch_size=1, precisions=["fp32"], checkpoint="none")
    report = api.validate(plan, mode="simulate")
    assert report.errors.get("peak_allocated") is not None
    assert report.errors.get("model_flops") is None  # not counted on a rank of several
    text = " ".join(_section("## Validate: run the plan").split())
    assert "FLOPs are compared on one-GPU plans" in text
    assert "its FLOPs are not counted" in text
