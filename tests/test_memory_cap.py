"""The memory cap: --hbm against the device's real usable memory (the size a card is sold as
means the whole card), --headroom kept free and the margin a plan leaves, and a cap below the
runtime reserve named as what it is."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_helpers import run_plan as run

from hardware.registry import bundled_names, load_hardware
from planner.errors import ConfigError, InfeasibleError
from planner.program.results import PlanResult
from roofplan import api

# its module-scoped fixtures are built once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("test_memory_cap")

H100 = load_hardware("h100-sxm")
TINY = ("--model", "tiny-llama", "--trials", "6")


def one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2 and out == "" and "Traceback" not in err, err
    [line] = err.strip().splitlines()
    assert line.startswith("plan: error: ")
    return line


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return api.load_model("tiny-llama")


# --------------------------------------------------------------------------------------------
# --hbm: the device's usable memory; the size it is sold as is the whole device


def test_80gib_on_an_80gb_h100_is_the_whole_card() -> None:
    """An "80 GB" H100 reports 81559 MiB (79.6 GiB): --hbm 80GiB used to be refused, with an A100
    suggested; it is the card's marketed size, so it means the whole card."""
    code, out, err = run(*TINY, "--hbm", "80GiB", "--json")
    assert code == 0, err
    assert json.loads(out)["hbm_cap_bytes"] == H100.hbm_bytes == 81559 * 2**20
    assert api.hbm_cap(H100, "80GiB") == H100.hbm_bytes
    assert api.hbm_cap(H100, "80GB") == 80 * 10**9  # below the card: a cap like any other


@pytest.mark.parametrize("name", [n for n in bundled_names() if load_hardware(n).marketed_hbm_gb is not None])
def test_the_marketed_size_in_gib_is_the_whole_device(name: str) -> None:
    hw = load_hardware(name)
    gb = hw.marketed_hbm_gb
    assert gb is not None and hw.hbm_source
    assert hw.usable_cap_bytes(round(gb * 2**30)) == hw.hbm_bytes
    assert hw.usable_cap_bytes(hw.hbm_bytes + 1) in (None, hw.hbm_bytes)  # only if that is its marketed size
    assert api.hbm_cap(hw, f"{gb:g}GB") == min(round(gb * 10**9), hw.hbm_bytes)


def test_a_cap_above_the_card_names_its_real_capacity_and_source() -> None:
    line = one_line_error(*run(*TINY, "--hbm", "81GiB"))
    assert "--hbm: 81GiB" in line and "85.5 GB (79.6 GiB; the driver-reported total, nvidia-smi memory.total)" in line
    assert "it is sold as 80 GB: --hbm 80GiB means the whole device" in line
    assert "--hardware h200 or b200 or mi300x" in line  # smallest first, each holds 81 GiB


def test_only_devices_with_more_memory_are_suggested() -> None:
    """85.8 GB is more than an H100 80GB reports; an A100 80GB reports 80 GiB (85.9 GB), but it is
    the same 80 GB class, not a device with more memory."""
    line = one_line_error(*run(*TINY, "--hbm", "85.8GB"))
    assert "a100" not in line and "h100-pcie" not in line
    assert "--hardware h200 or b200 or mi300x" in line
    # from a 40 GB A100 both are, the H100 too: 80 GiB is the whole of an "80 GB" H100
    with pytest.raises(ConfigError, match=r"\(--hardware h100-pcie or h100-sxm or a100-sxm-80gb or h200 or b200"):
        api.hbm_cap(load_hardware("a100-sxm-40gb"), "80GiB")


# --------------------------------------------------------------------------------------------
# --headroom: kept free of the cap; the margin a plan leaves


def test_headroom_is_kept_free(tiny: tuple[Any, Any]) -> None:
    """A cap the unconstrained plan fills to the byte: with 10 MB of headroom the plan leaves at
    least that free, and says so."""
    model, training = tiny
    filled = api.plan(model, training, n_trials=6).best.estimate.memory.device_bytes
    full = api.plan(model, training, hbm=filled, n_trials=6)
    assert full.margin_bytes == 0 and full.headroom_bytes == 0
    kept = api.plan(model, training, hbm=filled, n_trials=6, headroom="10MB")
    assert kept.hbm_cap_bytes == filled and kept.headroom_bytes == 10**7
    assert kept.best.estimate.memory.hbm_cap_bytes == filled - 10**7
    assert kept.margin_bytes == filled - kept.best.estimate.memory.device_bytes >= 10**7
    assert all(alt.estimate.memory.device_bytes <= filled - 10**7 for alt in kept.alternatives)


@pytest.mark.parametrize(("headroom", "expected"), [(0.05, 0.05), ("5%", 0.05), ("0.1", 0.1), (0, 0.0), (None, 0.0)])
def test_headroom_as_a_fraction_of_the_cap(tiny: tuple[Any, Any], headroom: Any, expected: float) -> None:
    model, training = tiny
    plan = api.plan(model, training, hbm="2GB", micro_batch_size=2, precisions=["fp32"], checkpoint="none",
                    headroom=headroom)
    assert plan.headroom_bytes == int(2e9 * expected)
    assert plan.inconsistencies() == ()


def test_headroom_in_the_report_the_json_and_the_plan_file(tmp_path: Any) -> None:
    path = tmp_path / "plan.json"
    code, out, err = run(*TINY, "--hbm", "2GB", "--headroom", "0.25", "--out", str(path), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["headroom_bytes"] == 5 * 10**8
    assert data["margin_bytes"] == 2 * 10**9 - data["best"]["estimate"]["memory"]["device_bytes"] >= 5 * 10**8
    loaded = PlanResult.load(path)  # what validate reads: the headroom is consistent with the estimates
    assert loaded.headroom_bytes == 5 * 10**8 and loaded.margin_bytes == data["margin_bytes"]
    code, out, err = run(*TINY, "--hbm", "2GB", "--headroom", "0.25")
    text = " ".join(out.split())
    assert code == 0 and "of 2.0 GB less 500.0 MB headroom," in text and "free ·" in text
    assert "--headroom: kept free" in text and "cap - device: what the plan leaves free" in text  # memory table


def test_the_default_report_says_what_is_free() -> None:
    code, out, _ = run(*TINY, "--micro-batch", "2", "--precision", "fp32", "--checkpoint", "none", "--hbm", "2GB")
    assert code == 0
    verdict = next(line for line in out.splitlines() if line.startswith(("FITS ", "DOES NOT FIT")))  # any width
    assert verdict.startswith("FITS ") and "of 2.0 GB, " in verdict and "%) free" in verdict
    assert "margin" in out


def test_headroom_that_leaves_nothing_fits_nothing() -> None:
    code, _, err = run(*TINY, "--hbm", "1.2GB", "--headroom", "0.2")
    assert code == 1
    assert "(the cap less 240.0 MB of --headroom)" in err.splitlines()[0]


@pytest.mark.parametrize(("value", "says"), [
    ("1.5", "neither a fraction of the cap below 1"),
    ("abc", "neither a fraction"),
    ("-0.1", "neither a fraction"),
    ("100%", "would keep the whole cap free"),
    ("100GB", "leaves nothing of the 85.5 GB cap"),
])
def test_bad_headroom_is_one_line(value: str, says: str) -> None:
    line = one_line_error(*run(*TINY, "--headroom", value))
    assert "--headroom" in line and says in line


def test_estimate_plan_takes_headroom_too(tiny: tuple[Any, Any]) -> None:
    model, training = tiny
    knobs = api.Knobs(micro_batch_size=8, precision="fp32")
    plan = api.estimate_plan(model, training, "h100-sxm", knobs, hbm="2GB", headroom="1GB")
    assert plan.best.estimate.memory.hbm_cap_bytes == 10**9 and plan.headroom_bytes == 10**9
    assert plan.inconsistencies() == ()


# --------------------------------------------------------------------------------------------
# a cap the runtime reserve alone exceeds


def test_a_cap_below_the_runtime_reserve_names_it() -> None:
    """--hbm 80MB used to blame the optimizer's temporaries and the activations (and search for
    more GPUs): the 1 GiB runtime reserve alone is more than the cap."""
    code, out, err = run(*TINY, "--hbm", "80MB", "--json")
    assert code == 1
    first, *rest = err.strip().splitlines()
    assert first == ("plan: nothing fits in 80.0 MB on h100-sxm: the runtime reserve (CUDA context, cuBLAS/NCCL "
                     "workspaces: runtime_reserve_bytes of h100-sxm) of 1.1 GB (1.0 GiB) alone exceeds the 80.0 MB "
                     "cap, before any parameter or activation")
    assert "optimizer" not in err and "activations," not in err and "more GPUs" not in err
    assert rest and "--hbm 2GB" in rest[-1]
    assert json.loads(out)["best"]["estimate"]["memory"]["fits"] is False  # the smallest plan, as before


def test_the_reserve_is_named_from_the_api(tiny: tuple[Any, Any]) -> None:
    model, training = tiny
    with pytest.raises(InfeasibleError, match="the runtime reserve .* alone exceeds the 1.0 GB cap"):
        api.plan(model, training, hbm="1GB", n_trials=4)
