"""Issue 21 item 13: long runs show real progress on a terminal: every step that can take more
than a second is named and its work counted (points priced of N in the smallest plan, GPU counts
tried in the fewest-GPUs advice), on stderr, never on a pipe."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

import roofplan.cli_support
from roofplan import api
from roofplan.cli import main as plan_main

# nothing fits one 80 GB GPU; four do (the advice's GPU counts are tried in turn)
INFEASIBLE = ("llama3-8b", {"hbm": "80GB"})


def _record() -> tuple[list[tuple[object, ...]], dict[str, object]]:
    calls: list[tuple[object, ...]] = []
    hooks = {"on_trial": lambda d, n: calls.append(("trial", d, n)),
             "on_stage": lambda text: calls.append(("stage", text)),
             "on_progress": lambda d, n: calls.append(("count", d, n))}
    return calls, hooks


def _counts_after(calls: list[tuple[object, ...]], stage: str) -> list[tuple[int, int]]:
    """The (done, total) counts reported while the stage whose name contains ``stage`` ran."""
    start = next(i for i, c in enumerate(calls) if c[0] == "stage" and stage in str(c[1]))
    out = []
    for call in calls[start + 1:]:
        if call[0] != "count":
            break
        out.append((int(call[1]), int(call[2])))  # type: ignore[call-overload]
    return out


def test_every_step_of_an_infeasible_search_counts_its_work() -> None:
    calls, hooks = _record()
    model, training = api.load_model(INFEASIBLE[0])
    with pytest.raises(api.InfeasibleError):
        api.plan(model, training, hbm=INFEASIBLE[1]["hbm"], **hooks)  # type: ignore[arg-type]
    trials = [c for c in calls if c[0] == "trial"]
    assert trials and trials[-1][1] == trials[-1][2]  # the known points, one by one
    assert len(trials) > 1
    smallest = _counts_after(calls, "smallest plan")
    assert smallest, calls
    assert [d for d, _ in smallest] == sorted(d for d, _ in smallest)  # it moves forward
    assert smallest[-1][0] == smallest[-1][1] > 0  # and ends at the space's points
    gpus = _counts_after(calls, "fewest GPUs")
    assert len(gpus) >= 2 and gpus[0] == (0, gpus[0][1]) and gpus[0][1] > 1, calls  # GPU counts tried of N


def test_a_search_that_fits_names_its_steps() -> None:
    calls, hooks = _record()
    model, training = api.load_model("tiny-llama", global_batch_size=8)
    api.plan(model, training, **hooks)  # type: ignore[arg-type]
    priced = _counts_after(calls, "pricing the best plans")
    assert priced and priced[-1][0] == priced[-1][1] >= 1


def _terminal(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(roofplan.cli_support, "progress_console",
                        lambda: Console(file=out, force_terminal=True, width=120))
    return out


def test_the_cli_draws_each_step_with_its_count_on_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    drawn = _terminal(monkeypatch)
    assert plan_main(["--model", INFEASIBLE[0], "--hbm", INFEASIBLE[1]["hbm"]]) == 1
    text = drawn.getvalue()
    assert "nothing fits: finding the smallest plan" in text
    assert "nothing fits: finding the fewest GPUs" in text
    assert "10/10" in text  # the smallest plan's points, all considered
    assert re.search(r"\b\d+/13\b", text)  # the fewest-GPU counts as they are tried
    assert "0:00:0" in text  # each step's own clock
    assert "nothing fits" not in capsys.readouterr().out  # progress stays off stdout


def test_no_progress_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--model", "tiny-llama", "--global-batch", "8", "--trials", "3"]) == 0
    err = capsys.readouterr().err
    assert "searching" not in err and "pricing" not in err
