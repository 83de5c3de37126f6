"""The search side of `plan`: free knobs searched, every search flag, infeasible requests, bad
values, and two processes sharing one optuna study."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import optuna
import pytest

from hardware.registry import load_hardware
from hardware.units import format_bytes
from planner.program.results import PlanResult
from roofplan import api
from roofplan.cli import main as plan_main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-llama", "--global-batch", "8"]
DIVISORS_OF_8 = (1, 2, 4, 8)
DEFAULT_PRECISIONS = ("bf16-mixed",)  # h100-sxm runs bf16: the default searches only the policy that trains like fp32
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# helpers (the style of tests/test_cli.py)


def call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = plan_main(argv)
    except SystemExit as exit_:  # argparse errors and --help
        code = exit_.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = call([*argv, "--json"], capsys)
    assert code == 0, err
    assert err == ""
    return json.loads(out)


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert re.match(r"^plan: error: \S", lines[0]), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def all_entries(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The knobs of every plan the result reports: best, alternatives, Pareto points."""
    return [data["best"]["knobs"], *(a["knobs"] for a in data["alternatives"]), *(p["knobs"] for p in data["pareto"])]


def device_bytes(model: str, global_batch: int, mb: int, precision: str, **checkpoint: Any) -> int:
    m, t = api.load_model(model, global_batch_size=global_batch)
    knobs = api.Knobs(micro_batch_size=mb, grad_accum_steps=global_batch // mb, precision=precision, **checkpoint)
    return api.estimate_plan(m, t, "h100-sxm", knobs).best.estimate.memory.device_bytes


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


# --------------------------------------------------------------------------------------------
# 1. free knobs are searched


def test_free_knobs_are_searched(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, *TINY)
    best = data["best"]
    knobs, est = best["knobs"], best["estimate"]
    assert knobs["micro_batch_size"] in DIVISORS_OF_8
    assert knobs["micro_batch_size"] * knobs["grad_accum_steps"] == 8
    assert knobs["precision"] in DEFAULT_PRECISIONS
    assert est["memory"]["fits"] is True
    assert est["memory"]["device_bytes"] <= data["hbm_cap_bytes"]

    search = data["search"]
    assert search["sampler"] == "tpe"
    assert search["n_trials"] == len(DIVISORS_OF_8)  # 4 plans, within the default 30 trials: priced whole
    assert 1 <= search["n_feasible"] <= search["n_trials"]
    assert isinstance(search["wall_s"], float) and search["wall_s"] > 0

    pareto = data["pareto"]
    assert isinstance(pareto, list) and pareto
    for point in pareto:
        assert set(point) == {"step_time_s", "device_bytes", "knobs"}
        assert point["device_bytes"] <= data["hbm_cap_bytes"]
    times = [p["step_time_s"] for p in pareto]
    sizes = [p["device_bytes"] for p in pareto]
    assert times == sorted(times)
    assert all(a > b for a, b in zip(sizes, sizes[1:], strict=False)), sizes  # non-dominated: strictly smaller as it slows
    assert len(pareto) > 1  # on tiny-llama smaller micro-batches / checkpointing trade time for memory
    assert pareto[0]["step_time_s"] == pytest.approx(est["step_time_s"], rel=1e-9)  # the best is on the front

    alternatives = data["alternatives"]
    assert alternatives
    for alt in alternatives:
        assert alt["estimate"]["memory"]["fits"] is True
        assert alt["estimate"]["memory"]["device_bytes"] <= data["hbm_cap_bytes"]
        assert alt["estimate"]["step_time_s"] >= est["step_time_s"]
        assert alt["knobs"] != knobs


def _fastest_tiny_llama() -> float:
    """Brute force: the fastest (micro-batch, precision) point of tiny-llama at global batch 8,
    uncheckpointed (under the default cap every point fits, and checkpointing only adds time)."""
    m, t = api.load_model("tiny-llama", global_batch_size=8)
    return min(
        api.estimate_plan(m, t, "h100-sxm", api.Knobs(micro_batch_size=mb, grad_accum_steps=8 // mb, precision=p))
        .best.estimate.step_time_s
        for mb in DIVISORS_OF_8 for p in DEFAULT_PRECISIONS
    )


def test_search_finds_the_fastest_point(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, *TINY)
    assert data["best"]["estimate"]["step_time_s"] == pytest.approx(_fastest_tiny_llama(), rel=1e-9)


# --------------------------------------------------------------------------------------------
# 2. every search flag


def test_help_lists_search_flags(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = call(["--help"], capsys)
    assert code == 0
    assert err == ""
    for flag in ("--sampler", "--trials", "--seed", "--storage", "--study-name", "--no-segments", "--out", "--plot"):
        assert flag in out, flag


@pytest.mark.parametrize(("global_batch", "precision", "n_sizes", "n_precisions"), [
    (8, None, 4, 1),
    (8, "bf16-mixed,bf16-true", 4, 2),
    (12, "fp32,bf16-true,bf16-mixed", 6, 3),
])
def test_exhaustive_trial_count(capsys: pytest.CaptureFixture[str], global_batch: int, precision: str | None,
                                n_sizes: int, n_precisions: int) -> None:
    extra = ["--precision", precision] if precision else []
    data = plan_json(capsys, "--model", "tiny-llama", "--global-batch", str(global_batch), "--sampler", "exhaustive",
                     *extra)
    assert data["search"]["sampler"] == "exhaustive"
    assert data["search"]["n_trials"] == n_sizes * n_precisions


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_exhaustive_prices_every_point(capsys: pytest.CaptureFixture[str], seed: int) -> None:
    """Regression: the known-good points enqueued first used to take grid slots, so the grid missed
    points (seed 1 missed 8 x bf16-true, the optimum) whatever the seed."""
    data = plan_json(capsys, *TINY, "--sampler", "exhaustive", "--seed", str(seed))
    assert data["search"]["n_evaluated"] == len(DIVISORS_OF_8) * len(DEFAULT_PRECISIONS)
    assert data["best"]["estimate"]["step_time_s"] == pytest.approx(_fastest_tiny_llama(), rel=1e-9)


@pytest.mark.parametrize("sampler", ["tpe", "random"])
@pytest.mark.parametrize("trials", [3, 12])
def test_trials_flag(capsys: pytest.CaptureFixture[str], sampler: str, trials: int) -> None:
    data = plan_json(capsys, *TINY, "--sampler", sampler, "--trials", str(trials))
    search = data["search"]
    assert search["sampler"] == sampler
    plans = len(DIVISORS_OF_8) * len(DEFAULT_PRECISIONS)
    if trials >= plans:  # the budget covers the space: every plan priced once
        assert search["n_trials"] == plans
    else:
        assert search["n_trials"] >= trials  # polishing may add neighbours of the incumbent
        assert search["n_trials"] <= trials + plans
    assert data["best"]["estimate"]["memory"]["fits"] is True


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_same_seed_same_result(capsys: pytest.CaptureFixture[str], sampler: str) -> None:
    argv = [*TINY, "--global-batch", "16", "--sampler", sampler, "--trials", "5", "--seed", "11"]
    first = plan_json(capsys, *argv)
    second = plan_json(capsys, *argv)
    assert first["best"]["knobs"] == second["best"]["knobs"]
    assert first["pareto"] == second["pareto"]
    assert first["alternatives"] == second["alternatives"]
    assert first["search"]["n_trials"] == second["search"]["n_trials"]


def test_same_seed_same_trial_sequence(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Not only the answer: the sampler proposes the same points in the same order."""
    sequences = []
    for i in range(2):
        url = sqlite_url(tmp_path / f"seed{i}.db")
        plan_json(capsys, *TINY, "--global-batch", "16", "--trials", "4", "--seed", "5", "--storage", url,
                  "--study-name", "s")  # 5 plans: more than the budget, so the sampler proposes
        study = optuna.load_study(study_name="s", storage=url)
        sequences.append([(t.params["micro_batch_size"], t.params["precision"]) for t in study.trials])
    assert sequences[0] == sequences[1]
    assert len(sequences[0]) >= 4


def test_precision_single(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, *TINY, "--precision", "bf16-true")
    assert {k["precision"] for k in all_entries(data)} == {"bf16-true"}
    assert len({k["micro_batch_size"] for k in all_entries(data)}) > 1  # micro-batch still searched


def test_precision_list(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    listed = {"fp32", "bf16-true", "bf16-mixed"}
    url = sqlite_url(tmp_path / "prec.db")
    data = plan_json(capsys, *TINY, "--precision", ",".join(sorted(listed)), "--storage", url, "--study-name", "p")
    assert data["best"]["knobs"]["precision"] == "bf16-true"  # the fastest of the three on an H100
    assert {k["precision"] for k in all_entries(data)} <= listed
    study = optuna.load_study(study_name="p", storage=url)
    assert {t.params["precision"] for t in study.trials} == listed  # every listed policy tried, no other


def test_micro_batch_fixed_others_free(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, *TINY, "--micro-batch", "2")
    entries = all_entries(data)
    assert data["best"]["knobs"]["micro_batch_size"] == 2
    assert {k["micro_batch_size"] for k in entries} == {2}
    assert {k["grad_accum_steps"] for k in entries} == {4}
    assert {k["precision"] for k in entries} == set(DEFAULT_PRECISIONS)  # precision searched
    assert len({tuple(k["checkpoint_blocks"]) for k in entries}) > 1  # placement solved, not fixed
    assert data["search"] is not None


def test_checkpoint_fixed_others_free(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, *TINY, "--checkpoint", "all")
    entries = all_entries(data)
    assert data["best"]["knobs"]["checkpoint_blocks"] == [0, 1]
    assert {tuple(k["checkpoint_blocks"]) for k in entries} == {(0, 1)}
    assert all(k["checkpoint_segments"] == [] for k in entries)
    assert len({k["micro_batch_size"] for k in entries}) > 1  # micro-batch searched
    est = data["best"]["estimate"]
    assert est["hardware_flops_per_step"] > est["model_flops_per_step"]  # the recompute is priced


def test_cap_where_only_checkpointing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    points = [(mb, p) for mb in DIVISORS_OF_8 for p in DEFAULT_PRECISIONS]
    plain = min(device_bytes("tiny-llama", 8, mb, p) for mb, p in points)
    checkpointed = min(device_bytes("tiny-llama", 8, mb, p, checkpoint_blocks=range(2)) for mb, p in points)
    assert checkpointed < plain
    cap = (plain + checkpointed) // 2  # no plan fits without checkpointing, some do with it
    data = plan_json(capsys, *TINY, "--hbm", str(cap))
    assert data["hbm_cap_bytes"] == cap
    best = data["best"]
    assert best["knobs"]["checkpoint_blocks"] or best["knobs"]["checkpoint_segments"]
    assert best["estimate"]["memory"]["fits"] is True
    assert best["estimate"]["memory"]["device_bytes"] <= cap
    assert best["estimate"]["hardware_flops_per_step"] > best["estimate"]["model_flops_per_step"]
    for point in data["pareto"]:
        assert point["device_bytes"] <= cap
        assert point["knobs"]["checkpoint_blocks"] or point["knobs"]["checkpoint_segments"]


def test_no_segments(capsys: pytest.CaptureFixture[str]) -> None:
    """A cap only a two-block segment fits: found by default, refused with --no-segments."""
    per_block = device_bytes("tiny-llama", 8, 1, "bf16-true", checkpoint_blocks=range(2))
    segment = device_bytes("tiny-llama", 8, 1, "bf16-true", checkpoint_segments=((0, 1),))
    assert segment < per_block
    cap = (segment + per_block) // 2
    data = plan_json(capsys, *TINY, "--precision", "bf16-true", "--hbm", str(cap))
    assert data["best"]["knobs"]["checkpoint_segments"] == [[0, 1]]
    assert data["best"]["estimate"]["memory"]["device_bytes"] <= cap

    code, out, err = call([*TINY, "--precision", "bf16-true", "--hbm", str(cap), "--no-segments", "--json"], capsys)
    assert code == 1, err
    assert "needs" in err and "Traceback" not in err
    assert "segments" not in err  # the smallest plan reported is a per-block one

    code, out, err = call([*TINY, "--no-segments", "--json"], capsys)  # roomy cap: no effect
    assert code == 0, err
    assert json.loads(out)["best"]["knobs"]["checkpoint_segments"] == []


def test_out_writes_the_plan_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    data = plan_json(capsys, *TINY, "--out", str(path))
    assert path.is_file()
    loaded = PlanResult.load(path)
    assert loaded.model_dump(mode="json") == data
    assert loaded.search is not None and loaded.pareto and loaded.alternatives

    again = tmp_path / "again.json"
    assert loaded.save(again) == again
    reloaded = PlanResult.load(again)
    assert reloaded == loaded
    assert reloaded.model_dump(mode="json") == data


def test_out_without_json_says_where(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    path = tmp_path / "plan.json"
    code, out, err = call([*TINY, "--out", str(path)], capsys)
    assert code == 0, err
    assert str(path) in out
    assert PlanResult.load(path).best.estimate.memory.fits


def test_plot_writes_pngs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    directory = tmp_path / "charts" / "nested"  # created if needed
    data = plan_json(capsys, *TINY, "--plot", str(directory))
    assert data["best"]["estimate"]["memory"]["fits"]
    for name in ("pareto.png", "memory.png"):
        path = directory / name
        assert path.is_file(), name
        assert path.stat().st_size > 5_000, name
        width, height = png_size(path)
        assert width > 200 and height > 200, (name, width, height)


def test_storage_and_study_name(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    url = sqlite_url(db)
    data = plan_json(capsys, *TINY, "--trials", "2", "--storage", url, "--study-name", "x")  # 4 plans: sampled
    search = data["search"]
    assert search["storage"] == url
    assert search["study_name"] == "x"
    assert db.is_file()
    study = optuna.load_study(study_name="x", storage=url)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == search["n_trials"]
    feasible = [t for t in complete if t.user_attrs["excess_bytes"] <= 0]
    assert len(feasible) == search["n_feasible"]
    assert data["best"]["estimate"]["step_time_s"] == pytest.approx(min(t.value for t in feasible), rel=1e-9)

    # joining the same study again adds this run's trials to it
    again = plan_json(capsys, *TINY, "--trials", "2", "--storage", url, "--study-name", "x")
    assert again["search"]["n_trials"] >= search["n_trials"] + 2


def test_no_storage_reports_none(capsys: pytest.CaptureFixture[str]) -> None:
    search = plan_json(capsys, *TINY, "--trials", "3")["search"]
    assert search["storage"] is None and search["study_name"] is None


# --------------------------------------------------------------------------------------------
# 3. nothing fits


def _smallest_llama3_8b() -> int:
    return min(device_bytes("llama3-8b", 512, 1, p, checkpoint_blocks=range(32)) for p in DEFAULT_PRECISIONS)


def _assert_infeasible_message(err: str, smallest: int) -> None:
    assert "Traceback" not in err
    assert f"needs {format_bytes(smallest)}" in err, err
    for part in ("params", "grads", "optimizer"):
        assert part in err, part
    # a larger cap is advised only where the device has it (a cap above the device is refused);
    # otherwise the advice names devices or GPU counts that hold the plan
    assert ("to fit: a cap of at least" in err) == (smallest <= load_hardware("h100-sxm").hbm_bytes)
    assert "--gpus" in err or "to fit: a cap" in err


def test_infeasible_exits_1_with_advice(capsys: pytest.CaptureFixture[str]) -> None:
    smallest = _smallest_llama3_8b()
    assert smallest > 80 * 10**9
    code, out, err = call(["--model", "llama3-8b", "--hbm", "80GB"], capsys)
    assert code == 1
    _assert_infeasible_message(err, smallest)

    code, out, err = call(["--model", "llama3-8b", "--hbm", "80GB", "--json"], capsys)
    assert code == 1
    _assert_infeasible_message(err, smallest)
    if out.strip():  # whatever goes to stdout under --json must still be JSON
        json.loads(out)


def test_infeasible_advice_names_the_fused_optimizer_when_its_temporaries_make_the_peak() -> None:
    """Short sequences, everything checkpointed: the peak is the foreach AdamW step's
    parameter-sized temporaries. The advice's figure for --optimizer-impl fused is that plan's own
    device footprint (here the backward peak then decides, as the advice warns)."""
    from planner.plan.knobs import Knobs
    from roofplan.advice import infeasible_message

    model, training = api.load_model("llama2-7b", seq_len=128, global_batch_size=1)
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=1, precision="bf16-mixed", checkpoint_blocks=tuple(range(32)))
    foreach = api.estimate_plan(model, training, "h100-sxm", knobs).best
    fused = api.estimate_plan(model, training.model_copy(update={"optimizer_impl": "fused"}), "h100-sxm", knobs).best
    assert foreach.estimate.memory.peak_phase.value == "optimizer"
    assert fused.estimate.memory.device_bytes < foreach.estimate.memory.device_bytes
    message = infeasible_message("h100-sxm", 80 * 10**9, foreach)
    found = re.search(r"with --optimizer-impl fused the step itself would need about ([0-9.]+) GB", message)
    assert found, message
    assert float(found.group(1)) * 1e9 == pytest.approx(fused.estimate.memory.device_bytes, rel=2e-3)
    long_seq = training.model_copy(update={"seq_len": 4096, "global_batch_size": 4})
    activations_peak = api.estimate_plan(
        model, long_seq, "h100-sxm", knobs.model_copy(update={"checkpoint_blocks": (), "micro_batch_size": 4})).best
    assert activations_peak.estimate.memory.peak_phase.value != "optimizer"
    assert "--optimizer-impl fused" not in infeasible_message("h100-sxm", 80 * 10**9, activations_peak)


# --------------------------------------------------------------------------------------------
# 4. bad values: exit 2, one stderr line naming the flag


def _bad_search_cases(tmp_path: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("not a directory")
    return {
        "sampler cmaes": ([*TINY, "--sampler", "cmaes"], ("--sampler", "cmaes")),
        "trials 0": ([*TINY, "--trials", "0"], ("--trials",)),
        "trials -3": ([*TINY, "--trials", "-3"], ("--trials", "-3")),
        "trials not int": ([*TINY, "--trials", "many"], ("--trials",)),
        "seed abc": ([*TINY, "--seed", "abc"], ("--seed", "abc")),
        "storage without study name": ([*TINY, "--storage", sqlite_url(tmp_path / "s.db")], ("--study-name",)),
        "storage not a url": ([*TINY, "--storage", "notaurl://x", "--study-name", "s"], ("--storage",)),
        "precision list with fp64": ([*TINY, "--precision", "fp64,bf16-mixed"], ("--precision", "fp64")),
        "plot is a file": ([*TINY, "--plot", str(a_file)], ("--plot",)),
        # these two let an OSError escape main() as a traceback before the product fix
        "out in a missing directory": ([*TINY, "--out", str(tmp_path / "missing" / "plan.json")], ("--out",)),
        "out is a directory": ([*TINY, "--out", str(tmp_path)], ("--out",)),
    }


with tempfile.TemporaryDirectory() as _scratch:
    BAD_CASE_NAMES = sorted(_bad_search_cases(Path(_scratch)))


@pytest.mark.parametrize("case", BAD_CASE_NAMES)
def test_bad_search_values_exit_2(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, needles = _bad_search_cases(tmp_path)[case]
    code, out, err = call(argv, capsys)
    assert_one_line_error(code, out, err, *needles)
    assert out == ""


def test_bad_storage_subprocess_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "roofplan.cli", *TINY, "--storage", "notaurl://x", "--study-name", "s"],
        check=False, capture_output=True, text=True, cwd=REPO, env={**os.environ, "COLUMNS": "120"}, timeout=120,
    )
    assert_one_line_error(result.returncode, result.stdout, result.stderr, "--storage")
