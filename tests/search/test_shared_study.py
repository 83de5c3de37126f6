"""Several `plan` workers sharing one optuna study (``--storage``): the race on creating optuna's
tables, the race on claiming a waiting trial, failed and abandoned trials, and two real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from test_search_cli import DEFAULT_PRECISIONS, DIVISORS_OF_8, REPO, TINY, call, sqlite_url


def _start_worker(url: str, seed: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "roofplan.cli", "--model", "tiny-llama", "--global-batch", "16", "--storage", url,
         "--study-name", "shared", "--trials", "3", "--seed", str(seed), "--json"],
        cwd=REPO, env={**os.environ, "COLUMNS": "120", **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def _run_workers(url: str, env: dict[str, str] | None = None) -> list[tuple[subprocess.Popen[str], str, str]]:
    """Two workers (seeds 1 and 2) on one study, run to the end: (process, stdout, stderr) each."""
    procs = [_start_worker(url, seed, env) for seed in (1, 2)]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [(proc, out, err) for proc, (out, err) in zip(procs, outputs, strict=True)]


# Loaded by the workers of the slow-database test (a sitecustomize on their PYTHONPATH): every read
# of a trial that is still waiting to be claimed takes half a second, as on a loaded machine.
_SLOW_CLAIM = """
import time
from optuna.storages._rdb import models
from optuna.trial import TrialState
_find = models.TrialModel.find_or_raise_by_id.__func__
def _slow_find(cls, trial_id, session, for_update=False):
    trial = _find(cls, trial_id, session, for_update)
    if trial.state == TrialState.WAITING:
        time.sleep(0.5)
    return trial
models.TrialModel.find_or_raise_by_id = classmethod(_slow_find)
import os
with open(os.environ["SLOW_CLAIM_MARKER"], "a") as marker:  # proof that the patch is in place
    marker.write("patched\\n")
"""


def test_two_workers_on_a_slow_database(tmp_path: Path) -> None:
    """Regression (seen once in CI): workers that enqueued the known-good points both claimed the
    same waiting trial on SQLite (a read, then a write), both ran it, and the second one's tell
    failed with "Cannot tell a COMPLETE trial". Widening that window to half a second made it fail
    every time; the search now adds those points as finished trials, so no trial waits to be claimed."""
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(_SLOW_CLAIM)
    url = sqlite_url(tmp_path / "shared.db")
    optuna.storages.RDBStorage(url)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path / "slow"), os.environ.get("PYTHONPATH")]))
    marker = tmp_path / "patched.txt"
    for proc, out, err in _run_workers(url, {"PYTHONPATH": pythonpath, "SLOW_CLAIM_MARKER": str(marker)}):
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "already set" not in err and "Error in sitecustomize" not in err
        assert json.loads(out)["best"]["estimate"]["memory"]["fits"] is True
    assert marker.read_text().splitlines() == ["patched", "patched"]  # both workers ran with the slow claim
    study = optuna.load_study(study_name="shared", storage=url)
    states = {t.state for t in study.trials}
    assert states <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}


def test_a_failed_trial_is_priced_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A point whose trial failed or was abandoned (a worker killed mid-trial) is not "seen": the
    next worker prices it (here the known-good point micro-batch 1, bf16-mixed)."""
    url = sqlite_url(tmp_path / "s.db")
    study = optuna.create_study(storage=url, study_name="s", direction="minimize")
    distributions = {"micro_batch_size": optuna.distributions.CategoricalDistribution(list(DIVISORS_OF_8)),
                     "precision": optuna.distributions.CategoricalDistribution(list(DEFAULT_PRECISIONS)),
                     "zero_stage": optuna.distributions.CategoricalDistribution([0])}
    params = {"micro_batch_size": 1, "precision": "bf16-mixed", "zero_stage": 0}
    for state in (optuna.trial.TrialState.FAIL, optuna.trial.TrialState.RUNNING):
        study.add_trial(optuna.trial.create_trial(state=state, params=params, distributions=distributions))
    code, _, err = call([*TINY, "--trials", "3", "--storage", url, "--study-name", "s", "--json"], capsys)
    assert code == 0, err
    complete = [t for t in optuna.load_study(study_name="s", storage=url).get_trials()
                if t.state == optuna.trial.TrialState.COMPLETE and t.params == params]
    assert complete and "excess_bytes" in complete[0].user_attrs


def test_search_never_leaves_a_trial_waiting(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The known-good points and the polish step's neighbours are priced in this process and added
    finished, first, with their memory constraint."""
    monkeypatch.setattr(optuna.Study, "enqueue_trial", lambda *a, **k: pytest.fail("enqueue_trial called"))
    url = sqlite_url(tmp_path / "one.db")
    code, out, err = call([*TINY, "--trials", "4", "--storage", url, "--study-name", "s", "--json"], capsys)
    assert code == 0, err
    study = optuna.load_study(study_name="s", storage=url)
    trials = study.get_trials()
    first = sorted(trials, key=lambda t: t.number)[: len(DEFAULT_PRECISIONS)]  # before any sampled trial
    assert sorted((t.params["micro_batch_size"], t.params["precision"]) for t in first) == [
        (1, p) for p in sorted(DEFAULT_PRECISIONS)]
    assert len({t.user_attrs["device_bytes"] - t.user_attrs["excess_bytes"] for t in trials}) == 1  # one cap
    for t in trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        if hasattr(optuna.trial.Trial, "set_constraint"):
            assert t.system_attrs["constraints:excess_bytes"] == t.user_attrs["excess_bytes"]


def test_two_processes_share_a_study(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "shared.db")
    # optuna creates its tables on first use and two processes doing that at the same instant race
    # (see test_workers_racing_to_create_the_storage); create them first, as optuna advises
    optuna.storages.RDBStorage(url)

    runs = _run_workers(url)
    procs = [proc for proc, _, _ in runs]
    for proc, _, err in runs:
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    results = [json.loads(out) for _, out, _ in runs]

    study = optuna.load_study(study_name="shared", storage=url)
    workers = {t.user_attrs.get("worker") for t in study.trials}
    assert workers == {f"{socket.gethostname()}:{proc.pid}" for proc in procs}  # two distinct workers
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    feasible = [t for t in complete if t.user_attrs["excess_bytes"] <= 0]
    assert feasible
    best_in_study = min(t.value for t in feasible)

    for result in results:
        assert result["search"]["study_name"] == "shared" and result["search"]["storage"] == url
        assert 3 <= result["search"]["n_trials"] <= len(complete)  # 5 plans, 3 trials each: sampled
        # no worker reports a plan better than the study holds
        assert result["best"]["estimate"]["step_time_s"] >= best_in_study * (1 - 1e-9)
    # the worker that read the study last saw every trial of both (the other had finished its
    # trials before its own read), and its answer is the study's best
    second = max(results, key=lambda r: r["search"]["n_trials"])
    assert second["search"]["n_trials"] == len(complete)
    assert second["best"]["estimate"]["step_time_s"] == pytest.approx(best_in_study, rel=1e-9)


def test_workers_racing_to_create_the_storage(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic version of the race: while this worker sets up a fresh storage, another one
    creates the same tables first (the real create_all runs, then this worker's own CREATE TABLE
    fails, as sqlite reports it when two processes both found the tables missing)."""
    from optuna.storages._rdb import models

    metadata = models.BaseModel.metadata
    real_create_all = metadata.create_all
    raced: list[bool] = []

    def create_all_losing_the_race(bind: Any, *args: Any, **kwargs: Any) -> None:
        if not raced:
            raced.append(True)
            real_create_all(bind)  # the other worker wins
            real_create_all(bind, checkfirst=False)  # this one's CREATE TABLE: "table ... already exists"
        real_create_all(bind, *args, **kwargs)

    monkeypatch.setattr(metadata, "create_all", create_all_losing_the_race)
    url = sqlite_url(tmp_path / "fresh.db")
    code, out, err = call([*TINY, "--trials", "3", "--storage", url, "--study-name", "shared", "--json"], capsys)
    assert raced
    assert code == 0, err
    assert json.loads(out)["search"]["storage"] == url
