"""The Python API: the CLI is a thin layer over it, its results round-trip through JSON, its
errors are PlannerError subclasses, it imports no torch, and the examples run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hardware.errors import PlannerError
from planner.program.results import PlanResult
from roofplan import api
from roofplan.cli import main as plan_main

ROOT = Path(__file__).resolve().parents[1]

REQUESTS = [
    # (CLI flags, API call)
    (["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32", "--checkpoint", "0"],
     lambda: api.plan(*api.load_model("tiny-llama"), micro_batch_size=2, precisions=["fp32"], checkpoint="0")),
    (["--model", "tiny-gpt2", "--hardware", "l4", "--hbm", "20GB", "--seed", "3"],
     lambda: api.plan(*api.load_model("tiny-gpt2"), "l4", "20GB", seed=3)),
    (["--model", "tiny-llama", "--global-batch", "16", "--seq-len", "64", "--precision", "bf16-mixed,bf16-true",
      "--sampler", "random", "--trials", "5", "--optimizer-impl", "fused"],
     lambda: api.plan(*api.load_model("tiny-llama", global_batch_size=16, seq_len=64, optimizer_impl="fused"),
                      precisions=["bf16-mixed", "bf16-true"], sampler="random", n_trials=5)),
    (["--model", "llama2-7b", "--hardware", "h200", "--checkpoint", "all", "--sampler", "exhaustive"],
     lambda: api.plan(*api.load_model("llama2-7b"), "h200", checkpoint="all", sampler="exhaustive")),
]


def _cli_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code = plan_main([*argv, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def _comparable(data: dict) -> dict:
    if data.get("search"):
        data["search"]["wall_s"] = 0.0
    return data


@pytest.mark.parametrize(("argv", "call"), REQUESTS, ids=["fixed", "search-seed", "random-sampler", "exhaustive-7b"])
def test_cli_json_equals_api_result(argv: list[str], call, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    assert _comparable(_cli_json(argv, capsys)) == _comparable(call().model_dump(mode="json"))


def test_infeasible_cli_json_equals_api_closest(capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_main(["--model", "llama3-8b", "--hbm", "80GB", "--json"])
    printed = json.loads(capsys.readouterr().out)
    with pytest.raises(api.InfeasibleError) as error:
        api.plan(*api.load_model("llama3-8b"), hbm="80GB")
    assert code == 1
    assert _comparable(printed) == _comparable(error.value.closest.model_dump(mode="json"))


def test_plan_file_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert plan_main(["--model", "tiny-llama", "--seed", "1", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    from_cli = PlanResult.load(out)
    from_api = api.plan(*api.load_model("tiny-llama"), seed=1)
    assert _comparable(from_cli.model_dump(mode="json")) == _comparable(from_api.model_dump(mode="json"))
    again = PlanResult.load(from_api.save(tmp_path / "again.json"))
    assert again == PlanResult.model_validate_json(from_api.model_dump_json())
    assert again.best.knobs == from_api.best.knobs and again.hardware == from_api.hardware


def test_results_are_frozen_and_render() -> None:
    result = api.plan(*api.load_model("tiny-llama"))
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        result.hbm_cap_bytes = 1  # type: ignore[misc]
    html = result._repr_html_()
    assert "FITS" in html and "tiny-llama" in html
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(result)
    assert "Memory" in console.export_text()


@pytest.mark.parametrize(
    "call",
    [
        lambda: api.load_model("no-such-model"),
        lambda: api.load_model({"model": {"family": "llama"}}),
        lambda: api.load_model("tiny-llama", seq_len=0),
        lambda: api.load_hardware("no-such-gpu"),
        lambda: api.plan(*api.load_model("tiny-llama"), hbm="80XB"),
        lambda: api.plan(*api.load_model("tiny-llama"), precisions=["fp64"]),
        lambda: api.plan(*api.load_model("tiny-llama"), sampler="cmaes"),
        lambda: api.plan(*api.load_model("tiny-llama"), n_trials=0),
        lambda: api.plan(*api.load_model("tiny-llama"), micro_batch_size=3),
        lambda: api.plan(*api.load_model("tiny-llama"), checkpoint="7"),
        lambda: api.plan(*api.load_model("tiny-llama"), "a100-sxm-80gb", precisions=["fp8-mixed"]),
        lambda: api.plan(*api.load_model("llama3-8b"), hbm="80GB"),
        lambda: PlanResult.load("/no/such/plan.json"),
    ],
)
def test_api_errors_are_planner_errors(call) -> None:  # noqa: ANN001
    with pytest.raises(PlannerError) as error:
        call()
    assert not isinstance(error.value, SystemExit)
    assert str(error.value)


def test_importing_the_api_imports_no_torch() -> None:
    code = ("import sys; from roofplan import api; import planner.program.results, roofplan.cli, search.study, validate.report; "
            "r = api.plan(*api.load_model('tiny-llama')); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


EXAMPLES = [
    ["examples/compare_gpus.py", "--model", "tiny-llama", "--devices", "h100-sxm,h200,l4"],
    ["examples/precision_table.py", "--model", "tiny-gpt2", "--device", "a100-sxm-80gb"],
    ["examples/seq_len_sweep.py", "--model", "tiny-llama", "--lengths", "64,128", "--global-batch", "8",
     "--device", "l4", "--gpus", "1", "--out", "{tmp}/sweep.png"],
    ["examples/zero_stages.py", "--model", "tiny-llama", "--gpus", "4", "--global-batch", "16"],
]


def _assert_example_shows_something(name: str, out: str, tmp_path: Path) -> None:
    """Each example's output is worth showing (issue 21 item 15): a plot with data in it, a device
    that fits, a layout named on every row."""
    if name == "seq_len_sweep":
        assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "2 of 2 lengths plotted" in out, out
        sizes = [int(m) for m in re.findall(r"largest micro-batch (\d+)", out)]
        assert len(sizes) == 2 and all(size >= 1 for size in sizes), out
    elif name == "compare_gpus":
        assert re.search(r"│ (h100-sxm|h200|l4) +│ yes ", out), out
    elif name == "zero_stages":
        rows = [line for line in out.splitlines() if re.match(r"│ [0-3] ", line)]
        assert len(rows) == 6, out  # ZeRO-0, ZeRO-1, ZeRO-2/3 both ways
        assert all("ZeRO-" in row or "TP " in row or "CP " in row for row in rows), out  # the layout, named
        assert sum("│ yes " in row for row in rows) >= 1, out
    if name != "seq_len_sweep":
        assert "tiny" in out  # the table's title names the model


@pytest.mark.parametrize("argv", EXAMPLES, ids=lambda a: Path(a[0]).stem)
def test_examples_run(argv: list[str], tmp_path: Path) -> None:
    args = [a.format(tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, cwd=ROOT, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    _assert_example_shows_something(Path(args[0]).stem, done.stdout, tmp_path)


def test_compare_gpus_defaults_show_a_device_that_fits_and_one_that_does_not() -> None:
    """The example's own defaults (llama2-7b, its published workload) answer both ways, not "no" twice."""
    done = subprocess.run([sys.executable, "examples/compare_gpus.py"], capture_output=True, text=True, check=False,
                          cwd=ROOT, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert re.search(r"│ h100-sxm +│ no ", done.stdout) and re.search(r"│ h200 +│ yes ", done.stdout), done.stdout


def test_readme_example_runs(tmp_path: Path) -> None:
    """The README's "Python API" snippet, as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "plan.json").exists()


def test_mypy_passes_on_the_typed_packages() -> None:
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "hardware", "planner", "search", "roofplan"], capture_output=True,
                          text=True, check=False, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
