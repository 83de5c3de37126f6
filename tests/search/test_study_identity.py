"""A shared study is for one workload: what it is for (model, training, hardware, cap, parallel
layout, search space) is recorded in the study, and a worker of another workload is refused with
one line (exit 2) instead of a traceback from optuna or a plan priced with another workload's trials."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from test_search_cli import DEFAULT_PRECISIONS, DIVISORS_OF_8, REPO, TINY, assert_one_line_error, call, sqlite_url

import search.identity
from hardware.registry import load_hardware
from planner.errors import ConfigError
from roofplan import api
from search.identity import study_identity
from search.space import build_space

IDENTITY_KEY = "roofplan_study"
FIX = "pick another --study-name"


def _args(url: str, *extra: str, name: str = "s") -> list[str]:
    return [*TINY, "--trials", "3", "--storage", url, "--study-name", name, *extra]


def _trials(url: str, name: str = "s") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=url).get_trials()


def _record(seq_len: int | None = None) -> dict[str, Any]:
    """The record another worker planning tiny-llama (global batch 8, h100-sxm, defaults) writes."""
    model, training = api.load_model("tiny-llama", global_batch_size=8, seq_len=seq_len)
    hw = load_hardware("h100-sxm")
    identity = study_identity(model, training, hw, hw.hbm_bytes, build_space(model, training, hw))
    return search.identity._identity_record(identity)


def _legacy_trial(mb: int = 1) -> optuna.trial.FrozenTrial:
    """A finished trial as an older roofplan (no study identity) added it."""
    distributions = {"micro_batch_size": optuna.distributions.CategoricalDistribution(list(DIVISORS_OF_8)),
                     "precision": optuna.distributions.CategoricalDistribution(list(DEFAULT_PRECISIONS)),
                     "zero_stage": optuna.distributions.CategoricalDistribution([0])}
    knobs = api.Knobs(micro_batch_size=mb, grad_accum_steps=8 // mb).model_dump(mode="json")
    return optuna.trial.create_trial(
        value=1e-4, params={"micro_batch_size": mb, "precision": "bf16-mixed", "zero_stage": 0},
        distributions=distributions,
        user_attrs={"worker": "old", "pruned": False, "knobs": knobs, "device_bytes": 1, "excess_bytes": -1,
                    "pareto": []})


def test_same_workload_joins_and_its_trials_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = sqlite_url(tmp_path / "s.db")
    code, _, err = call(_args(url), capsys)
    assert code == 0, err
    first = len(_trials(url))
    stored = optuna.load_study(study_name="s", storage=url).user_attrs[IDENTITY_KEY]
    assert stored["identity"]["model"]["name"] == "tiny-llama"
    assert stored["identity"]["training"]["global_batch_size"] == 8
    assert "tiny-llama" in stored["summary"] and "h100-sxm" in stored["summary"]

    code, _, err = call(_args(url, "--seed", "7", "--trials", "2"), capsys)  # another seed and budget: same study
    assert code == 0, err
    assert len(_trials(url)) > first
    assert optuna.load_study(study_name="s", storage=url).user_attrs[IDENTITY_KEY] == stored


@pytest.mark.parametrize(("extra", "needle"), [
    (["--model", "tiny-gpt2"], "model is tiny-gpt2, not tiny-llama"),
    (["--seq-len", "64"], "training.seq_len is 64"),
    (["--global-batch", "16"], "training.global_batch_size is 16, not 8"),
    (["--hbm", "20GB"], "cap is 20.0 GB"),
    (["--hardware", "h200"], "hardware is h200, not h100-sxm"),
    (["--gpus", "2"], "parallel.world_size is 2, not 1"),
    (["--precision", "bf16-mixed,bf16-true"], "space.dimensions.precision is [bf16-mixed,bf16-true], not [bf16-mixed]"),
    (["--checkpoint", "all"], "space.fixed_checkpoint"),
    (["--attention", "eager"], "model.attention is eager, not flash"),
], ids=["model", "seq-len", "global-batch", "hbm", "hardware", "gpus", "precision", "checkpoint", "attention"])
def test_another_workload_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 extra: list[str], needle: str) -> None:
    url = sqlite_url(tmp_path / "s.db")
    code, _, err = call(_args(url), capsys)
    assert code == 0, err
    before = len(_trials(url))
    code, out, err = call(_args(url, *extra), capsys)  # later flags override TINY's
    assert_one_line_error(code, out, err, "--study-name 's'", needle, "it was made for tiny-llama", FIX,
                          "--storage")
    assert len(_trials(url)) == before  # refused before any trial was added


def test_a_profile_with_the_same_name_and_other_figures_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = sqlite_url(tmp_path / "s.db")
    code, _, err = call(_args(url), capsys)
    assert code == 0, err
    data = load_hardware("h100-sxm").model_dump(mode="json")
    data["memory_efficiency"] = data["memory_efficiency"] * 0.9  # a calibrated copy, same name
    profile = tmp_path / "h100-calibrated.yaml"
    profile.write_text(yaml.safe_dump(data))
    code, out, err = call(_args(url, "--hardware", str(profile)), capsys)
    assert_one_line_error(code, out, err, "hardware profile h100-sxm has other figures", FIX)

    del data["memory_efficiency"], data["description"]  # only its text differs: the same figures
    data["memory_efficiency"] = load_hardware("h100-sxm").memory_efficiency
    data["description"] = "a copy with another description"
    profile.write_text(yaml.safe_dump(data))
    code, _, err = call(_args(url, "--hardware", str(profile)), capsys)
    assert code == 0, err


def test_api_plan_refuses_another_workload(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "api.db")
    model, training = api.load_model("tiny-llama", global_batch_size=8)
    first = api.plan(model, training, n_trials=3, storage=url, study_name="api")
    again = api.plan(model, training, n_trials=3, seed=1, storage=url, study_name="api")
    assert first.search is not None and again.search is not None
    assert again.search.n_trials > first.search.n_trials
    model, longer = api.load_model("tiny-llama", global_batch_size=8, seq_len=64)
    with pytest.raises(ConfigError) as refused:
        api.plan(model, longer, n_trials=3, storage=url, study_name="api")
    assert refused.value.exit_code == 2
    message = str(refused.value)
    assert "training.seq_len is 64" in message and FIX in message and "\n" not in message


def test_a_legacy_study_with_finished_trials_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Made by an older roofplan (no identity): its trials may be of any workload."""
    url = sqlite_url(tmp_path / "old.db")
    study = optuna.create_study(storage=url, study_name="s", direction="minimize")
    study.add_trial(_legacy_trial())
    code, out, err = call(_args(url), capsys)
    assert_one_line_error(code, out, err, "--study-name 's'", "without a record of what it is for",
                          "1 finished trials", FIX)
    assert len(_trials(url)) == 1
    assert IDENTITY_KEY not in optuna.load_study(study_name="s", storage=url).user_attrs


def test_an_empty_legacy_study_is_adopted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """No trial in it can count: its identity is recorded (after waiting for a creator that never writes)."""
    monkeypatch.setattr(search.identity, "_GRACE_S", 0.2)
    url = sqlite_url(tmp_path / "old.db")
    optuna.create_study(storage=url, study_name="s", direction="minimize")
    code, _, err = call(_args(url), capsys)
    assert code == 0, err
    assert optuna.load_study(study_name="s", storage=url).user_attrs[IDENTITY_KEY] == _record()
    code, out, err = call(_args(url, "--seq-len", "64"), capsys)
    assert_one_line_error(code, out, err, "training.seq_len", FIX)


@pytest.mark.parametrize("same", [True, False], ids=["same-workload", "other-workload"])
def test_a_joiner_waits_for_the_creators_record(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch, same: bool) -> None:
    """Two workers racing on one study name: the other one created the study and writes its record
    while this one waits; the creator's record stands and this worker compares against it."""
    url = sqlite_url(tmp_path / "race.db")
    optuna.create_study(storage=url, study_name="s", direction="minimize")  # the creator, before its write
    creators = _record() if same else _record(seq_len=64)
    waits: list[int] = []

    def creator_writes_now() -> None:
        waits.append(1)
        if len(waits) == 2:
            optuna.load_study(study_name="s", storage=url).set_user_attr(IDENTITY_KEY, creators)

    monkeypatch.setattr(search.identity, "_pause", creator_writes_now)
    code, out, err = call(_args(url), capsys)
    assert len(waits) == 2
    if same:
        assert code == 0, err
        assert _trials(url)
    else:
        assert_one_line_error(code, out, err, "training.seq_len is 128, not 64", "it was made for tiny-llama", FIX)
        assert not _trials(url)
    assert optuna.load_study(study_name="s", storage=url).user_attrs[IDENTITY_KEY] == creators  # first writer wins


def test_two_processes_of_different_workloads_racing(tmp_path: Path) -> None:
    """Started together on one fresh study: exactly one creates it and plans; the other is refused."""
    url = sqlite_url(tmp_path / "race.db")
    optuna.storages.RDBStorage(url)  # optuna's tables first (test_shared_study covers that race)
    procs = [subprocess.Popen([sys.executable, "-m", "roofplan.cli", *_args(url, "--seq-len", seq)], cwd=REPO,
                              env={**os.environ, "COLUMNS": "120"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for seq in ("64", "128")]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    codes = [proc.returncode for proc in procs]
    assert sorted(codes) == [0, 2], outputs
    winner = codes.index(0)
    _, err = outputs[1 - winner]
    assert_one_line_error(2, "", err, "--study-name 's'", "training.seq_len", FIX)
    stored = optuna.load_study(study_name="s", storage=url).user_attrs[IDENTITY_KEY]
    assert stored["identity"]["training"]["seq_len"] == (64, 128)[winner]
    assert {t.user_attrs["study_identity"] for t in _trials(url)} == {stored["sha256"][:16]}


def test_a_trial_of_another_space_never_surfaces_as_a_traceback(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Should a trial over other choices ever reach a study of this workload first (a foreign
    writer), optuna's "CategoricalDistribution does not support dynamic value space" becomes one
    error line, not a traceback."""
    url = sqlite_url(tmp_path / "s.db")
    study = optuna.create_study(storage=url, study_name="s", direction="minimize")
    study.set_user_attr(IDENTITY_KEY, _record())  # made for this workload
    foreign = {"micro_batch_size": optuna.distributions.CategoricalDistribution([1, 2]),
               "precision": optuna.distributions.CategoricalDistribution(["bf16-true"]),
               "zero_stage": optuna.distributions.CategoricalDistribution([0])}
    study.add_trial(optuna.trial.create_trial(
        value=1.0, params={"micro_batch_size": 1, "precision": "bf16-true", "zero_stage": 0},
        distributions=foreign, user_attrs={"study_identity": "foreign", "excess_bytes": -1}))
    code, out, err = call(_args(url), capsys)
    assert_one_line_error(code, out, err, "another search space", FIX)
