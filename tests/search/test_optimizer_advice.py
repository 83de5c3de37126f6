"""Issue 21 item 9: when only the fused optimizer makes a plan fit, the "nothing fits" advice says
so, measured (not "more GPUs do not help, shorten the sequence").

torch 2.13 runs AdamW's foreach path unless ``fused=True`` is passed (torch/optim/adam.py
``adam()``: "we default to foreach and pass False to use_fused ... to give the fused impl
bake-in time"), so the planner prices foreach by default and names fused as the fix."""

from __future__ import annotations

import re

import pytest

from roofplan import api

SEVENTY_B = ("llama3-70b", {"global_batch_size": 1})


def _infeasible(**load: object) -> tuple[str, api.PlanResult]:
    model, training = api.load_model(SEVENTY_B[0], **{**SEVENTY_B[1], **load})  # type: ignore[arg-type]
    with pytest.raises(api.InfeasibleError) as caught:
        api.plan(model, training, "h100-sxm", gpus=16)
    assert caught.value.closest is not None
    return str(caught.value), caught.value.closest  # type: ignore[return-value]


def test_advice_names_the_fused_optimizer_when_it_makes_the_plan_fit() -> None:
    message, closest = _infeasible()
    model, training = api.load_model(SEVENTY_B[0], optimizer_impl="fused", **SEVENTY_B[1])  # type: ignore[arg-type]
    fitting = api.plan(model, training, "h100-sxm", gpus=16)  # the same request with fused: it fits
    assert fitting.best.estimate.memory.fits
    assert "to fit: --optimizer-impl fused" in message, message
    found = re.search(r"a plan then needs ([0-9.]+ [KMGT]?B)", message)
    assert found, message
    # the figure is measured: a plan priced with the fused optimizer, within the cap
    needs = float(found.group(1).split()[0]) * 1e9
    assert needs <= closest.hbm_cap_bytes
    assert "more GPUs do not help:" not in message  # with fused they need not: no misleading verdict
    assert "(the forward/backward peak may then decide)" not in message  # measured, not hedged


@pytest.mark.filterwarnings("ignore:training.seq_len")
def test_advice_says_when_the_fused_optimizer_does_not_make_it_fit() -> None:
    """A longer sequence: the fused optimizer takes the temporaries off but activations stay above
    the cap; the advice gives the measured figure and does not offer fused as the fix."""
    message, closest = _infeasible(seq_len=131072)
    assert "to fit: --optimizer-impl fused" not in message
    found = re.search(r"with --optimizer-impl fused \(.*?\) this plan would still need ([0-9.]+ [KMGT]?B)", message)
    assert found, message
    fused_needs = float(found.group(1).split()[0]) * 1e9
    assert closest.hbm_cap_bytes < fused_needs < closest.best.estimate.memory.device_bytes


@pytest.mark.filterwarnings("ignore:training.seq_len")
def test_no_fused_advice_when_fused_is_already_used() -> None:
    model, training = api.load_model("llama3-70b", global_batch_size=1, seq_len=131072, optimizer_impl="fused")
    with pytest.raises(api.InfeasibleError) as caught:
        api.plan(model, training, "h100-sxm", gpus=16)
    assert "--optimizer-impl fused" not in str(caught.value)
