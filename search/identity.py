"""What a shared study is for, recorded in the study and checked by every worker that joins it.

A study is for one workload. Its identity (model, training, hardware profile, cap, parallel
layout, search space) is recorded in the study's user attrs by the worker that creates it, before
any trial is added; every other worker compares before adding one, and one whose identity differs
is refused with one ``ConfigError`` line (exit 2), so another workload's trials never count and
never reach the sampler.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import optuna

from hardware.profile import HardwareProfile
from hardware.units import format_bytes
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from search.space import SearchSpace

Distributions = dict[str, optuna.distributions.BaseDistribution]


# What a study is for. Stored once per study under _IDENTITY_KEY:
#   {"version", "sha256", "summary", "identity": {model, training, hardware, cap_bytes, parallel, space}}
# The worker that created the study writes it at once, before any trial; the others never write
# it (so it is never overwritten): they read it, waiting a moment for the creator's write, and
# compare. Only a study made without one (an older roofplan) is adopted by a joiner. Each trial
# also carries the identity's hash (TRIAL_TAG), and only trials of this identity count.

_IDENTITY_KEY = "roofplan_study"
TRIAL_TAG = "study_identity"
# 2: the space gained context parallelism, checkpoint policies and the (tp, cp) layouts; the model
# its implementation and attention variants; 3: a point's plans may mix two checkpoint policies
# across blocks (a trial's value can be lower than version 2's); 4: expert parallelism (the ep
# dimension, all-to-all times, MoE experts as their own FSDP2 units)
_IDENTITY_VERSION = 4
_DOC_FIELDS = frozenset({"description", "sources", "time_validation", "figure_sources"})  # text, not figures
_LAYOUT_FIELDS = ("world_size", "gpus_per_node", "fsdp_grad_sync")
_LABELS = frozenset({"model.name"})  # shown, never compared: a label does not change a trial's value
_FIX = "pick another --study-name (or another --storage)"
_GRACE_S = 3.0  # how long a joiner waits for the creator's record before calling the study legacy


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def study_identity(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap_bytes: int,
                   space: SearchSpace) -> dict[str, Any]:
    """What a study's trials depend on, as JSON data. The hardware profile enters by name and by
    a hash of every figure (a calibrated or user profile can reuse a bundled name)."""
    figures = hw.model_dump(mode="json", exclude=set(_DOC_FIELDS))
    layout = space.model_dump(mode="json")
    parallel = {key: layout.pop(key) for key in _LAYOUT_FIELDS}
    del layout["global_batch_size"]  # the training's, recorded there
    return {
        "model": model.model_dump(mode="json"),
        "training": training.model_dump(mode="json"),
        "hardware": {"name": hw.name, "profile_sha256": hashlib.sha256(_canonical(figures).encode()).hexdigest()},
        "cap_bytes": cap_bytes,
        "parallel": parallel,
        "space": layout,
    }


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _compared(identity: dict[str, Any]) -> dict[str, object]:
    return {path: v for path, v in _flatten(identity).items() if path not in _LABELS}


def _identity_hash(identity: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(_compared(identity)).encode()).hexdigest()


def _summary(identity: dict[str, Any]) -> str:
    """One short line: what the study is for."""
    model, training, hw = identity["model"], identity["training"], identity["hardware"]
    parallel, space = identity["parallel"], identity["space"]
    gpus = parallel["world_size"]
    dims = space["dimensions"]
    stages = "/".join(str(z) for z in dims["zero_stage"])
    text = (f"{model['name']} ({model['family']}, {model['n_layers']} layers), seq {training['seq_len']} x batch "
            f"{training['global_batch_size']}, {training['optimizer']}, on {hw['name']} with a "
            f"{format_bytes(identity['cap_bytes'])} cap, {gpus} GPU{'s' if gpus != 1 else ''} ZeRO-{stages}, "
            f"micro-batch {','.join(str(b) for b in dims['micro_batch_size'])}, "
            f"{','.join(dims['precision'])}")
    if space.get("fixed_checkpoint") is not None:
        text += f", checkpoint {','.join(str(b) for b in space['fixed_checkpoint']) or 'none'}"
    return text


def _shown(path: str, value: object) -> str:
    if path == "cap_bytes" and isinstance(value, int):
        return format_bytes(value)
    if isinstance(value, list):
        return f"[{','.join(str(v) for v in value)}]"
    return "none" if value is None else str(value)


def _differences(stored: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """What differs, readable: "model is llama3-8b, not llama2-7b", "training.seq_len is 2048, not 4096"."""
    old, new = _compared(stored), _compared(ours)
    paths = [p for p in dict.fromkeys([*old, *new]) if old.get(p, "<absent>") != new.get(p, "<absent>")]
    out: list[str] = []
    old_name, new_name = stored.get("model", {}).get("name"), ours["model"]["name"]
    if any(p.startswith("model.") for p in paths) and old_name != new_name:
        out.append(f"model is {new_name}, not {old_name}")
        paths = [p for p in paths if not p.startswith("model.")]
    if "hardware.name" in paths:  # another profile: its figures differ too, say it once
        paths = [p for p in paths if p != "hardware.profile_sha256"]
    for path in paths:
        if path == "hardware.profile_sha256":
            out.append(f"the hardware profile {ours['hardware']['name']} has other figures (an edited or calibrated "
                       f"profile)")
            continue
        label = {"cap_bytes": "cap", "hardware.name": "hardware"}.get(path, path)
        out.append(f"{label} is {_shown(path, new.get(path))}, not {_shown(path, old.get(path))}")
    return out


def _refuse(study_name: str | None, why: str) -> ConfigError:
    return ConfigError(f"--study-name {study_name!r}: {why}; {_FIX}")


def _check_legacy(trials: list[optuna.trial.FrozenTrial], ours: Distributions, study_name: str | None) -> None:
    """A study without an identity (an older roofplan made it) is adopted only while no finished
    trial could count and no trial searched another space."""
    finished = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    other_space = [t for t in trials if any(ours.get(name) != d for name, d in t.distributions.items())]
    if finished or other_space:
        held = f"{len(finished)} finished trials" if finished else "trials over another search space"
        raise _refuse(study_name, f"this study was made without a record of what it is for (by an older roofplan or "
                               f"by hand) and already holds {held}, which may be of another workload")


def _identity_record(identity: dict[str, Any]) -> dict[str, Any]:
    """What goes into the study's user attrs under _IDENTITY_KEY."""
    return {"version": _IDENTITY_VERSION, "sha256": _identity_hash(identity), "summary": _summary(identity),
            "identity": identity}


def _pause() -> None:
    time.sleep(0.1)


def join(study: optuna.Study, created: bool, identity: dict[str, Any], ours: Distributions,
         study_name: str | None) -> str:
    """Record this study's identity (its creator), or check it against the one stored (a joiner);
    returns the tag of this identity's trials. Runs before any trial is added."""
    record = _identity_record(identity)
    wrote = created
    if created:
        study.set_user_attr(_IDENTITY_KEY, record)
    deadline = time.monotonic() + _GRACE_S
    while True:
        stored = study.user_attrs.get(_IDENTITY_KEY)
        if stored is not None:
            break
        trials = study.get_trials(deepcopy=False)
        if wrote:
            raise ConfigError(f"--study-name {study_name!r}: could not record what this study is for in "
                              f"--storage (the write did not persist)")
        if not trials and time.monotonic() < deadline:
            _pause()  # just created by another worker, whose record comes before any trial
            continue
        _check_legacy(trials, ours, study_name)  # made without a record: adopted if nothing in it can count
        study.set_user_attr(_IDENTITY_KEY, record)
        wrote = True
    if not (isinstance(stored, dict) and stored.get("version") == _IDENTITY_VERSION
            and isinstance(stored.get("identity"), dict)):
        version = stored.get("version") if isinstance(stored, dict) else None
        raise _refuse(study_name, f"this study was made by another roofplan version (its record is version "
                               f"{version!r}, this one writes {_IDENTITY_VERSION}), whose trials cannot be compared "
                               "with this one's")
    theirs: dict[str, Any] = stored["identity"]
    if _compared(theirs) != _compared(identity):
        differs = "; ".join(_differences(theirs, identity))
        summary = str(stored.get("summary", "")) or _summary(theirs)
        raise _refuse(study_name, f"this study is for another workload, whose trials must not count here ({differs}); "
                               f"it was made for {summary}")
    return str(record["sha256"])[:16]


@contextmanager
def same_space(study_name: str | None) -> Iterator[None]:
    """Optuna refuses a parameter whose choices differ from an earlier trial's (another search
    space): one ConfigError line, never a traceback, should such a trial ever reach the study."""
    try:
        yield
    except ValueError as error:
        if "dynamic value space" not in str(error) and "different distribution" not in str(error):
            raise
        raise _refuse(study_name, "this study holds trials over another search space (optuna: "
                               f"{str(error).strip()})") from None


def complete_trials(study: optuna.Study, tag: str) -> list[optuna.trial.FrozenTrial]:
    """The finished trials of this identity (a trial of another one, left by a race, never counts)."""
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.user_attrs.get(TRIAL_TAG) == tag]
