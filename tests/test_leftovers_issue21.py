"""Issue 21 item 14 (leftovers): a precision the search leaves out of multi-GPU layouts is named,
with the reason, in one line; the memory table's model-state lines agree with their own bytes
(the count per rank times the bytes each is the figure printed beside it)."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from roofplan import api
from roofplan.cli import main as plan_main
from roofplan.render import memory_table

TINY = ["--model", "tiny-llama", "--global-batch", "8"]


def _call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = plan_main(argv)
    return code, capsys.readouterr().err


def test_fp8_left_out_of_fsdp2_layouts_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _call([*TINY, "--gpus", "4", "--precision", "fp8-mixed,bf16-mixed", "--trials", "3"], capsys)
    assert code == 0
    notes = [line for line in err.splitlines() if "fp8-mixed" in line]
    assert len(notes) == 1, err
    assert notes[0].startswith("plan: warning: --precision: fp8-mixed left out of ")
    assert "FSDP2" in notes[0] and "layouts" in notes[0]


def test_fp8_dropped_by_a_fixed_fsdp2_stage_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _call([*TINY, "--gpus", "4", "--zero-stage", "3", "--precision", "fp8-mixed,bf16-mixed",
                       "--trials", "3"], capsys)
    assert code == 0
    assert "fp8-mixed left out of the search" in err, err


@pytest.mark.parametrize("argv", [
    [*TINY, "--precision", "fp8-mixed,bf16-mixed", "--trials", "3"],  # one GPU: every precision runs
    [*TINY, "--gpus", "4", "--trials", "3"],  # the default policy runs under FSDP2
])
def test_no_note_when_nothing_is_left_out(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _call(argv, capsys)
    assert code == 0
    assert "left out" not in err, err


_COUNT = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
_BYTES = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _napkin(math: str) -> float:
    """The bytes a model-state line's napkin math says: count [+ count] [/ ranks] × [k ×] bytes."""
    left, right = math.split(" × ", 1)
    count = sum(float(n) * _COUNT[s] for n, s in re.findall(r"(\d+(?:\.\d+)?)([KMBT])\b", left))
    shared = re.search(r"/ (\d+)", left)
    if shared:
        count /= int(shared.group(1))
    for factor in re.findall(r"\d+(?:\.\d+)?", right.split("(")[0]):
        count *= float(factor)
    return count


def _state_lines(result: api.PlanResult) -> dict[str, tuple[str, float]]:
    console = Console(width=400, record=True)
    console.print(memory_table(result))
    out = {}
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if len(cells) == 3 and cells[0] in ("parameters", "gradients", "optimizer state"):
            number, unit = cells[2].split()
            out[cells[0]] = (cells[1], float(number) * _BYTES[unit])
    return out


@pytest.mark.parametrize(("gpus", "tp", "zero", "precision"), [
    (8, 8, 0, "bf16-mixed"),  # TP alone: the embedding's gradient is whole on every rank
    (4, 4, 0, "bf16-true"),
    (8, 4, 3, "bf16-mixed"),  # FSDP2 x TP: sharded gradients have the parameters' shape
    (8, 1, 3, "bf16-mixed"),  # FSDP2 alone
])
def test_model_state_lines_agree_with_their_bytes(gpus: int, tp: int, zero: int | None, precision: str) -> None:
    model, training = api.load_model("llama3-8b", global_batch_size=8)
    result = api.plan(model, training, gpus=gpus, tp=tp, zero_stage=zero, precisions=[precision], n_trials=3)
    for what, (math, shown) in _state_lines(result).items():
        assert _napkin(math) == pytest.approx(shown, rel=0.02), f"{what}: {math} = {shown:.3g}"
