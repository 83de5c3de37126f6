"""What a new user hit on a fresh clone: a cap above the device, validate without torch or
with a missing file. Each test failed before its fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError
from roofplan import api
from roofplan.cli import main as plan_main

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys: pytest.CaptureFixture[str], code: int, prog: str) -> str:
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def test_a_cap_above_the_device_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, plan_main(["--model", "tiny-llama", "--hbm", "200GB"]), "plan")
    assert "--hbm: 200GB" in line and "85.5 GB" in line and "h100-sxm" in line  # the cap, the device's memory
    assert "--hardware" in line and "mi300x" in line  # the fix: a device that has that much
    assert "cpu" not in line  # not a device of another kind


def test_cap_equal_to_the_device_is_accepted() -> None:
    hw = load_hardware("h100-sxm")
    assert api.hbm_cap(hw, hw.hbm_bytes) == hw.hbm_bytes
    assert api.hbm_cap(hw, None) == hw.hbm_bytes
    with pytest.raises(ConfigError, match="--hbm"):
        api.hbm_cap(hw, hw.hbm_bytes + 1)


def test_the_api_refuses_it_too() -> None:
    model, training = api.load_model("tiny-llama")
    with pytest.raises(ConfigError, match="more than the"):
        api.plan(model, training, "l4", "30GB")
    with pytest.raises(ConfigError, match="more than the"):
        api.estimate_plan(model, training, "l4", api.Knobs(micro_batch_size=1, grad_accum_steps=8), hbm="30GB")


def _plan_file(tmp_path: Path) -> Path:
    model, training = api.load_model("tiny-llama", global_batch_size=8)
    path = tmp_path / "plan.json"
    api.estimate_plan(model, training, "h100-sxm", api.Knobs(micro_batch_size=1, grad_accum_steps=8)).save(path)
    return path


def _validate_without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    """`validate` in a process where torch cannot be imported (a base install)."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from roofplan.validate_cli import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_validate_without_torch_says_what_to_install(tmp_path: Path) -> None:
    done = _validate_without_torch(str(_plan_file(tmp_path)))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.strip() == ("validate: error: needs torch, which is not installed; pip install torch "
                                   "(or roofplan[validate])")


def test_validate_checks_the_file_before_importing_torch(tmp_path: Path) -> None:
    """`validate missing.json` took 3-13 s (the torch import) to say the file is missing."""
    done = _validate_without_torch(str(tmp_path / "missing.json"))
    assert done.returncode == 2
    assert "missing.json: cannot read it" in done.stderr and "Traceback" not in done.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = _validate_without_torch(str(bad))
    assert done.returncode == 2 and "plan file" in done.stderr and "Traceback" not in done.stderr
    for argv, needle in ((["--steps", "0"], "--steps"), (["--hardware", "nope"], "nope"),
                         (["--mode", "simulate", "--device", "cuda"], "--device")):
        done = _validate_without_torch(str(_plan_file(tmp_path)), *argv)
        assert done.returncode == 2 and needle in done.stderr and "torch" not in done.stderr, done.stderr


def test_validate_missing_file_never_imports_torch() -> None:
    """The check that made `validate missing.json` take seconds: torch is not imported for it."""
    probe = subprocess.run([sys.executable, "-c", "import sys; from roofplan.validate_cli import main\n"
                            "code = main(['/nonexistent/plan.json'])\n"
                            "print(code, 'torch' in sys.modules)"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert probe.stdout.strip() == "2 False", probe.stderr


def test_the_readme_main_job_fits_and_its_command_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's first command: install, then the main job; it must fit (exit 0), and the
    synopsis must list every flag `plan --help` has."""
    import re

    text = (REPO / "README.md").read_text()
    command = re.search(r"pip install -e \. && plan (.+)\n", text)
    assert command is not None
    argv = command.group(1).split()
    assert plan_main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["estimate"]["memory"]["fits"] is True
    synopsis = text[text.index("## Using `plan`"):text.index("- `--model`")]
    from roofplan.cli import build_parser

    flags = {o for action in build_parser()._actions for o in action.option_strings if o.startswith("--")}
    missing = sorted(f for f in flags - {"--help"} if f not in synopsis)
    assert not missing, missing
