"""The search: an optuna study over (micro-batch, precision), placement solved exactly per point.

Optuna owns the search: seeded samplers (TPE by default, random, or an exhaustive grid), the HBM
cap as a constraint (``device_bytes - cap <= 0``), known-good points priced first, and an
optional RDB storage (``sqlite:///study.db``, PostgreSQL, MySQL) so several ``plan`` processes on
several machines share one study; the result is read back from the study, so every worker's
trials count. The objective is step time at the fixed global batch.

The sampler sees the space's named dimensions (``search.space``). For each point the checkpoint
placement is not sampled (2^L booleans) but solved exactly (``search.candidates``). A space with
no more plans than the trial budget is priced whole (the result is exhaustive enumeration's);
a larger one is sampled, and after the sampler's budget the unvisited neighbours of the
incumbent (adjacent micro-batches, each other choice of every other dimension) are priced too,
so a sampler that stalls still ends at the best point around it.

A study is for one workload (``search.identity``): a worker joining a study made for another
workload is refused before it adds a trial.
"""

from __future__ import annotations

import inspect
import os
import socket
import time
import warnings
from collections.abc import Callable
from enum import StrEnum

import optuna
from pydantic import BaseModel, ConfigDict, Field

from hardware.profile import HardwareProfile
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.program.results import ParetoPoint, PlanEntry, SearchStats
from search.candidates import Evaluation, evaluate
from search.identity import TRIAL_TAG, complete_trials, join, same_space, study_identity
from search.pareto import non_dominated
from search.smallest import smallest_plan
from search.space import Point, SearchSpace
from search.steps import Steps

_HAS_SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")
_CREATE_TAKES_CONSTRAINTS = "constraints" in inspect.signature(optuna.trial.create_trial).parameters


class SamplerKind(StrEnum):
    TPE = "tpe"
    RANDOM = "random"
    EXHAUSTIVE = "exhaustive"


class SearchOptions(BaseModel):
    """How to search (what to search is the SearchSpace)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    sampler: SamplerKind = SamplerKind.TPE
    n_trials: int = Field(default=30, gt=0, description="sampler trials in this process")
    seed: int = 0
    storage: str | None = Field(default=None, description="optuna RDB URL shared by several workers")
    study_name: str | None = None
    polish: bool = True
    n_alternatives: int = Field(default=4, ge=0)


class SearchOutcome(BaseModel):
    """What the study found: the best feasible plan (if any), runners-up, Pareto front, stats."""

    model_config = ConfigDict(frozen=True)
    best: PlanEntry | None
    alternatives: tuple[PlanEntry, ...]
    pareto: tuple[ParetoPoint, ...]
    closest: PlanEntry | None  # when nothing fits: the plan of the space with the least device memory
    stats: SearchStats


def _sampler(options: SearchOptions, space: SearchSpace) -> optuna.samplers.BaseSampler:
    def constraints(trial: optuna.trial.FrozenTrial) -> list[float]:
        return [float(trial.user_attrs.get("excess_bytes", 0.0))]

    if options.sampler is SamplerKind.EXHAUSTIVE:
        grid = {name: list(choices) for name, choices in space.dimensions.items()}
        return optuna.samplers.GridSampler(grid, seed=options.seed)  # type: ignore[arg-type]
    if options.sampler is SamplerKind.RANDOM:
        return optuna.samplers.RandomSampler(seed=options.seed)
    legacy = {} if _HAS_SET_CONSTRAINT else {"constraints_func": constraints}  # optuna < 5
    with warnings.catch_warnings():  # optuna < 5 marks both options experimental, on every plan
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=options.seed,
            n_startup_trials=min(8, max(2, space.size // 3)),
            multivariate=True,
            **legacy,  # type: ignore[arg-type]
        )


def _create_study(options: SearchOptions, space: SearchSpace) -> tuple[optuna.Study, bool]:
    """Create or join the study: (study, whether this worker created it). Workers started together
    on a fresh database race to create optuna's tables (optuna issue #1092); the loser retries and
    joins the winner's study. Of workers racing to create one study, exactly one creates it."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    attempts = 6 if options.storage else 1
    for attempt in range(attempts):
        try:
            try:
                return optuna.create_study(storage=options.storage, study_name=options.study_name,
                                           direction="minimize", sampler=_sampler(options, space)), True
            except optuna.exceptions.DuplicatedStudyError:
                if options.storage is None:
                    raise
                return optuna.load_study(study_name=str(options.study_name), storage=options.storage,
                                         sampler=_sampler(options, space)), False
        except ImportError as error:
            raise ConfigError(f"--storage: {options.storage!r} needs a database driver: {error}") from None
        except Exception as error:  # optuna, sqlalchemy and drivers raise their own types
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            racing = "already exists" in first_line or "UNIQUE constraint" in first_line or "locked" in first_line
            if racing and attempt + 1 < attempts:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise ConfigError(f"--storage: cannot open study {options.study_name!r} at {options.storage!r}: "
                              f"{first_line}") from None
    raise AssertionError("unreachable")


WORKER = f"{socket.gethostname()}:{os.getpid()}"


def _attrs(ev: Evaluation, tag: str) -> dict[str, object]:
    """What a trial records about its point (every worker reads these back from the study)."""
    chosen = ev.chosen
    feasible = [p for p in ev.points if p.device_bytes <= ev.cap_bytes]
    return {
        "worker": WORKER,
        TRIAL_TAG: tag,
        "pruned": ev.pruned,
        "knobs": chosen.knobs.model_dump(mode="json"),
        "device_bytes": chosen.device_bytes,
        "excess_bytes": chosen.device_bytes - ev.cap_bytes,
        "pareto": [p.model_dump(mode="json") for p in non_dominated(feasible)],
    }


def _record(trial: optuna.Trial, ev: Evaluation, tag: str) -> float:
    for key, value in _attrs(ev, tag).items():
        trial.set_user_attr(key, value)
    if _HAS_SET_CONSTRAINT:  # feasibility as a constraint: device_bytes - cap <= 0
        trial.set_constraint("excess_bytes", float(ev.chosen.device_bytes - ev.cap_bytes))
    return ev.chosen.step_time_s


def _distributions(space: SearchSpace) -> dict[str, optuna.distributions.BaseDistribution]:
    """The same choices the objective suggests from (optuna refuses a trial whose distributions differ)."""
    return {name: optuna.distributions.CategoricalDistribution(list(choices))
            for name, choices in space.dimensions.items()}


def _add_points(
    study: optuna.Study,
    space: SearchSpace,
    points: list[Point],
    price: Callable[[Point], Evaluation],
    tag: str,
    on_progress: Callable[[int, int], None] | None = None,
) -> int:
    """Price these points here and add them to the study as finished trials; returns how many were new.

    Not ``enqueue_trial``: a waiting trial is claimed by a read then a write, and on SQLite two
    workers can both claim it, run it, and the second one's ``tell`` fails ("Cannot tell a
    COMPLETE trial"). A finished trial added in one write cannot be claimed twice; two workers
    adding the same point at once leave a harmless duplicate. ``on_progress(done, points)`` follows
    the points."""
    seen = {_key(space, t) for t in complete_trials(study, tag)}  # a failed or abandoned trial's point is priced again
    added = 0
    for done, point in enumerate(points):  # known-good points and neighbours are allowed by construction
        if on_progress is not None:
            on_progress(done, len(points))
        if space.key(point) in seen:
            continue
        seen.add(space.key(point))
        ev = price(point)
        excess = float(ev.chosen.device_bytes - ev.cap_bytes)
        constraint = ({"constraints": {"excess_bytes": excess}} if _CREATE_TAKES_CONSTRAINTS
                      else {"system_attrs": {"constraints": [excess]}})  # optuna < 5: the list format
        study.add_trial(optuna.trial.create_trial(value=ev.chosen.step_time_s, params=dict(point),
                                                  distributions=_distributions(space), user_attrs=_attrs(ev, tag),
                                                  **constraint))  # type: ignore[arg-type]
        added += 1
    return added


def run_search(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    cap_bytes: int,
    space: SearchSpace,
    options: SearchOptions,
    on_trial: Callable[[int, int], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> SearchOutcome:
    """Run (or join) the study and read the answer back from it. ``on_trial(done, planned)``
    follows the trials; ``on_stage(text)`` names a longer step that has no trials to count and
    ``on_progress(done, total)`` counts that step's work (points priced, plans priced in full)."""
    steps = Steps(on_stage, on_progress)
    start = time.perf_counter()
    price, evaluations = _memoized_pricer(model, training, hw, cap_bytes, space, options)

    def objective(trial: optuna.Trial) -> float:
        point = {name: trial.suggest_categorical(name, list(choices)) for name, choices in space.dimensions.items()}
        if not space.allows(point):  # type: ignore[arg-type]
            raise optuna.TrialPruned(f"{point} is not a plan (a policy its strategy does not run, or a micro-batch "
                                     "that does not divide a rank's sequences)")
        return _record(trial, price(point), tag)  # type: ignore[arg-type]

    study, created = _create_study(options, space)
    identity = study_identity(model, training, hw, cap_bytes, space)
    tag = join(study, created, identity, _distributions(space), options.study_name)  # before any trial
    n_trials = space.size if options.sampler is SamplerKind.EXHAUSTIVE else options.n_trials
    done = 0
    if options.sampler is not SamplerKind.EXHAUSTIVE:  # the grid visits every point by itself
        done, n_trials = _price_known_points(study, space, options, price, tag, n_trials, on_trial)
        if on_trial is not None and done:
            on_trial(done, n_trials)

    def progress(_study: optuna.Study, _trial: optuna.trial.FrozenTrial) -> None:
        nonlocal done
        done += 1
        if on_trial is not None:
            on_trial(done, n_trials)

    with same_space(options.study_name):
        study.optimize(objective, n_trials=max(0, n_trials - done), callbacks=[progress])
        if options.polish and options.sampler is not SamplerKind.EXHAUSTIVE:
            _polish(study, space, price, evaluations, tag, steps)
    return _read_outcome(study, tag, model, training, hw, cap_bytes, space, options, len(evaluations), start, steps)


def _memoized_pricer(
    model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap_bytes: int, space: SearchSpace,
    options: SearchOptions,
) -> tuple[Callable[[Point], Evaluation], dict[tuple[object, ...], Evaluation]]:
    """``price(point)``, evaluating each point of the space once, and the evaluations it fills in.

    It keeps the plans that fit priced so far, fastest first: a point none of whose placements can
    be among the best 1 + n_alternatives, nor smaller than the fastest, is bounded (never on the
    answer, the runners-up or the Pareto front). The exhaustive grid is the reference: it bounds nothing."""
    evaluations: dict[tuple[object, ...], Evaluation] = {}
    kept: list[ParetoPoint] = []
    bound = options.sampler is not SamplerKind.EXHAUSTIVE

    def price(point: Point) -> Evaluation:
        key = space.key(point)
        if key not in evaluations:
            rank = 1 + options.n_alternatives
            beat = (kept[rank - 1].step_time_s, kept[0].device_bytes) if bound and len(kept) >= rank else None
            ev = evaluate(model, training, hw, cap_bytes, space.knobs_at(training, point), space.fixed_checkpoint,
                          space.allow_segments, beat=beat,
                          policies=space.checkpoint_policies)
            if ev.fits and not ev.pruned:
                kept.append(ev.chosen)
                kept.sort(key=lambda p: (p.step_time_s, p.device_bytes))
            evaluations[key] = ev
        return evaluations[key]

    return price, evaluations


def _price_known_points(
    study: optuna.Study, space: SearchSpace, options: SearchOptions, price: Callable[[Point], Evaluation], tag: str,
    n_trials: int, on_trial: Callable[[int, int], None] | None = None,
) -> tuple[int, int]:
    """Before a sampler runs: (trials added, trials planned). A space no larger than the budget is
    priced whole (a sampler would prune or revisit); else its known-good points are, and they are
    the budget when there are more of them than --trials. ``on_trial`` follows them."""
    plans = list(space.points())
    whole = len(plans) <= n_trials
    known = plans if whole else space.known_good()
    planned = len(known) if whole else max(n_trials, len(known))
    follow = (lambda done, _n: on_trial(done, planned)) if on_trial is not None else None
    with same_space(options.study_name):
        done = _add_points(study, space, known, price, tag, follow)
    return done, done if whole else max(n_trials, done)


def _read_outcome(
    study: optuna.Study, tag: str, model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap_bytes: int,
    space: SearchSpace, options: SearchOptions, n_evaluated: int, start: float, steps: Steps,
) -> SearchOutcome:
    """The answer read back from the study (every worker's trials): the fastest distinct plans that
    fit, priced again in full, their Pareto front, and when nothing fits the smallest plan."""
    from planner.program.estimate import estimate

    trials = complete_trials(study, tag)
    feasible = sorted((t for t in trials if _a_plan_that_fits(t)), key=lambda t: (t.value, t.number))
    distinct: list[Knobs] = []
    for t in feasible:
        knobs = Knobs.model_validate(t.user_attrs["knobs"])
        if knobs not in distinct:
            distinct.append(knobs)

    def entry(knobs: Knobs) -> PlanEntry:
        return PlanEntry(knobs=knobs, estimate=estimate(model, training, hw, knobs, cap_bytes))

    reported = distinct[: 1 + options.n_alternatives]
    entries = []
    for i, knobs in enumerate(reported):
        if i == 0:
            steps.stage("pricing the best plans in full")
        steps.count(i, len(reported))
        entries.append(entry(knobs))
        steps.count(i + 1, len(reported))
    best = entries[0] if entries else None
    alternatives = tuple(entries[1:])
    points = [ParetoPoint.model_validate(p) for t in feasible for p in t.user_attrs.get("pareto", [])]
    # nothing fits: the least memory over the whole space, computed directly (not the smallest
    # point a sampler happened to visit), so every sampler reports the same plan
    closest = None
    if best is None:
        steps.stage("nothing fits: finding the smallest plan")
        closest = entry(smallest_plan(model, training, hw, space, on_progress=steps.on_progress).knobs)
        if closest.estimate.memory.fits:  # the sampler missed every plan that fits; the smallest one does
            best, closest = closest, None
    stats = SearchStats(
        sampler=options.sampler.value,
        n_trials=len(trials),
        n_feasible=len(feasible),
        n_evaluated=n_evaluated,
        wall_s=time.perf_counter() - start,
        study_name=study.study_name if options.storage else None,
        storage=options.storage,
    )
    return SearchOutcome(best=best, alternatives=alternatives, pareto=tuple(non_dominated(points)),
                         closest=closest, stats=stats)


def _a_plan_that_fits(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial whose plan fits the cap (one bounded by a faster plan's time was never walked)."""
    return trial.user_attrs.get("excess_bytes", 1) <= 0 and not trial.user_attrs.get("pruned", False)


def _key(space: SearchSpace, trial: optuna.trial.FrozenTrial) -> tuple[object, ...]:
    return space.key(trial.params)


POLISHED_LEADERS = 5  # the polish walks from the best plan, then from the runners-up


def _polish(
    study: optuna.Study,
    space: SearchSpace,
    price: Callable[[Point], Evaluation],
    evaluations: dict[tuple[object, ...], Evaluation],
    tag: str,
    steps: Steps | None = None,
) -> None:
    """Price the unvisited neighbours of the best plan, then of the runners-up, until none of
    the leaders has an unvisited neighbour (a leader's neighbour that wins becomes a leader);
    ``steps`` follows each pass."""
    while True:
        trials = complete_trials(study, tag)
        feasible = [t for t in trials if _a_plan_that_fits(t)]
        if not feasible:
            return
        visited = {_key(space, t) for t in trials} | set(evaluations)
        leaders = sorted(feasible, key=lambda t: (t.value, t.number))[:POLISHED_LEADERS]
        fresh = []
        for leader in leaders:  # the best plan's neighbours first; the runners-up's once those are all priced
            fresh = [n for n in space.neighbours(leader.params) if space.key(n) not in visited]
            if fresh:
                break
        if not fresh:
            return
        if steps is not None:
            steps.stage("polishing: pricing the neighbours of the best plans")
        # each pass completes at least one new point: it ends
        _add_points(study, space, fresh, price, tag, steps.on_progress if steps is not None else None)

