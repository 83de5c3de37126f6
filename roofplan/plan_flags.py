"""``plan``'s knob flags checked one by one into what the planner takes (``--fsdp-grad-sync``,
``--checkpoint-policy``, ``--precision``, ``--checkpoint``): a bad value is one line naming the
flag and the choices. ``finetune_flags`` reads ``--finetune``, ``--lora-rank``, ``--lora-alpha`` and
``--lora-targets`` over the model file's ``finetune:`` section."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from planner.errors import ConfigError
from planner.finetune.config import QLORA_REFUSAL, FinetuneConfig, FinetuneMethod
from planner.graph.blocks import describe
from planner.model.config import ModelConfig
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


def finetune_flags(model: ModelConfig, method: str | None = None, rank: int | None = None,
                   targets: str | Sequence[str] | None = None, alpha: float | None = None) -> ModelConfig:
    """``model`` with the fine-tuning the flags ask for, over its file's ``finetune:`` section
    (checked: the method, the sizes, every target naming a linear of the model)."""
    given = {"method": method, "rank": rank, "target_modules": targets, "alpha": alpha}
    flags = {"method": "--finetune", "rank": "--lora-rank", "target_modules": "--lora-targets", "alpha": "--lora-alpha"}
    if model.finetune is None and method is None:
        extra = next((flags[k] for k, v in given.items() if v is not None), None)
        if extra is None:
            return model
        raise ConfigError(f"{extra}: applies to a fine-tuning plan; add --finetune lora (or a finetune: section)")
    if method is not None and method.strip().lower() not in {m.value for m in FinetuneMethod}:
        raise ConfigError(f"--finetune: {method!r} is not a method; use {', '.join(m.value for m in FinetuneMethod)}")
    fields = {**(model.finetune.model_dump() if model.finetune else {}),
              **{k: (v.strip().lower() if k == "method" and isinstance(v, str) else v)
                 for k, v in given.items() if v is not None}}
    try:
        finetune = FinetuneConfig.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "finetune"
        raise ConfigError(f"{flags.get(field, 'finetune.' + field)}: {first['msg']}") from None
    if finetune.method is FinetuneMethod.QLORA:
        raise ConfigError(QLORA_REFUSAL)
    tuned = model.model_copy(update={"finetune": finetune})
    describe(tuned)  # a target that names no linear: one line listing the model's linears
    return tuned


def check_finetune_gpus(model: ModelConfig, gpus: int) -> None:
    """LoRA plans are priced on one GPU (data-parallel adapters and sharded frozen bases are not)."""
    if model.finetune is not None and gpus > 1:
        raise ConfigError(f"--gpus: a fine-tuning plan ({model.finetune.method.value}) is priced on one GPU; "
                          f"leave out --gpus {gpus}")
