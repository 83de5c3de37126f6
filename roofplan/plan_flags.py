"""``plan``'s knob flags checked one by one into what the planner takes (``--fsdp-grad-sync``,
``--checkpoint-policy``, ``--precision``, ``--checkpoint``): a bad value is one line naming the
flag and the choices."""

from __future__ import annotations

from collections.abc import Sequence

from planner.errors import ConfigError
from planner.plan.checkpointing import CheckpointPolicy
from planner.plan.knobs import GradSync, parse_checkpoint_spec
from planner.precision import PrecisionPolicy


def grad_sync_flag(value: str | GradSync, gpus: int, zero_stage: int | None) -> GradSync:
    """``--fsdp-grad-sync``, checked against the plan's sharding."""
    try:
        sync = GradSync(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        raise ConfigError(f"--fsdp-grad-sync: {value!r} is not a mode; use every or last") from None
    if sync is GradSync.LAST and (gpus < 2 or (zero_stage is not None and zero_stage < 2)):
        raise ConfigError("--fsdp-grad-sync: last applies to ZeRO-2/3 (FSDP2) on several GPUs; DDP and ZeRO-1 "
                          "already reduce once per step (use --gpus N and --zero-stage 2 or 3, or leave it every)")
    return sync


def checkpoint_policy_flag(value: str | CheckpointPolicy | None) -> CheckpointPolicy | None:
    """``--checkpoint-policy``, checked."""
    if value is None or isinstance(value, CheckpointPolicy):
        return value
    try:
        return CheckpointPolicy(value.strip().lower())
    except ValueError:
        choices = ", ".join(p.value for p in CheckpointPolicy)
        raise ConfigError(f"--checkpoint-policy: {value!r} is not a policy; use {choices}") from None


def precisions_flag(precisions: Sequence[str] | str | None) -> tuple[PrecisionPolicy, ...] | None:
    if precisions is None:
        return None
    names = [p.strip() for p in (precisions.split(",") if isinstance(precisions, str) else precisions) if p.strip()]
    try:
        return tuple(PrecisionPolicy(name) for name in names) or None
    except ValueError:
        bad = next(n for n in names if n not in {p.value for p in PrecisionPolicy})
        choices = ", ".join(p.value for p in PrecisionPolicy)
        raise ConfigError(f"--precision: {bad!r} is not a policy; use {choices}") from None


def checkpoint_blocks_flag(checkpoint: str | Sequence[int] | None, n_layers: int) -> tuple[int, ...] | None:
    if checkpoint is None:
        return None
    if isinstance(checkpoint, str):
        return parse_checkpoint_spec(checkpoint, n_layers)
    return parse_checkpoint_spec(",".join(str(int(b)) for b in checkpoint) or "none", n_layers)
