"""Activation checkpointing below the block: what each policy recomputes and what it keeps.

A plan checkpoints some blocks with one policy (``Knobs.checkpoint_policy``); the others keep
everything autograd saves:

| policy | PyTorch | kept for backward | rerun before the block's backward |
|---|---|---|---|
| ``full`` | ``torch.utils.checkpoint`` on the block | the block's inputs | the block's forward |
| ``attention`` | ``torch.utils.checkpoint`` on the attention core only (Korthikanti et al. 2022, "selective recompute") | everything but what the core saves (its T x T scores and dropout masks in eager attention; flash attention's log-sum-exp) | the attention core |
| ``ops`` | ``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts``: a save list names the ops whose outputs are kept (torchtitan's "selective op" AC) | the block's inputs and the outputs of the listed ops | every other op of the block |

torchtitan's default save list (pytorch/torchtitan ``torchtitan/models/llama3/infra/parallelize.py``
@81c1243, ``_save_list`` and ``_custom_policy``): ``aten.mm``, the flash and memory-efficient SDPA
kernels, ``reduce_scatter_tensor`` (sequence parallelism) and ``aten.max``, "except every second
mm" of a block (a counter per checkpointed call: of a Llama block's seven matmuls q, k, v, o,
gate, up, down, the outputs of q, v, gate and down are kept, k, o and up recomputed). A linear
with a bias runs ``addmm``, not in the list. Under SAC an op whose output is kept is not run
again: its cached output is returned in the recompute.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.ops.base import OpKind


class CheckpointPolicy(StrEnum):
    """How a checkpointed block is checkpointed."""

    FULL = "full"  # the whole block: only its inputs are kept
    ATTENTION = "attention"  # the attention core only (Korthikanti's selective recompute)
    OPS = "ops"  # per-op selective checkpointing with a save list (torchtitan's "selective op")


class SavedOp(StrEnum):
    """Op families a save list can name (what PyTorch's aten ops they are: ``validate.checkpoint``)."""

    MATMUL = "matmul"  # aten.mm (a linear without a bias)
    ATTENTION = "attention"  # the fused SDPA kernel's outputs (output and log-sum-exp)
    REDUCE_SCATTER = "reduce_scatter"  # sequence parallelism's reduce-scatter


_FAMILIES: dict[SavedOp, frozenset[OpKind]] = {
    SavedOp.MATMUL: frozenset({OpKind.LINEAR}),
    SavedOp.ATTENTION: frozenset({OpKind.ATTENTION_FLASH, OpKind.ATTENTION_RING}),
    SavedOp.REDUCE_SCATTER: frozenset({OpKind.REDUCE_SCATTER_TO_SEQUENCE}),
}
_ATTENTION_CORES = frozenset({OpKind.ATTENTION_FLASH, OpKind.ATTENTION_EAGER, OpKind.ATTENTION_RING})


class SaveList(BaseModel):
    """What per-op selective checkpointing keeps: the op families saved, and whether only every
    other matmul of a block is (torchtitan's policy)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ops: tuple[SavedOp, ...] = Field(default=tuple(SavedOp), validate_default=True,
                                     description="op families whose outputs are saved")
    alternate_matmuls: bool = Field(default=True, description="save the 1st, 3rd, ... matmul of a block only")

    @field_validator("ops", mode="after")
    @classmethod
    def _canonical(cls, ops: tuple[SavedOp, ...]) -> tuple[SavedOp, ...]:
        """Sorted, once each: one list, one identity (plan files, shared studies)."""
        return tuple(sorted(set(ops)))

    @property
    def label(self) -> str:
        names = ",".join(sorted(op.value for op in self.ops)) or "nothing"
        return f"{names}{' (every second matmul recomputed)' if self.alternate_matmuls and SavedOp.MATMUL in self.ops else ''}"


TORCHTITAN_SAVE_LIST = SaveList()


def parse_save_list(text: str) -> SaveList:
    """``torchtitan`` (the default) or a comma list of ``matmul``, ``attention``, ``reduce_scatter``
    (every matmul saved); the errors name ``--save-list``."""
    from planner.errors import ConfigError

    value = text.strip().lower()
    if value in ("", "torchtitan"):
        return TORCHTITAN_SAVE_LIST
    try:
        ops = tuple(SavedOp(part.strip()) for part in value.split(",") if part.strip())
    except ValueError:
        choices = ", ".join(op.value for op in SavedOp)
        raise ConfigError(f"--save-list: {text!r} is not torchtitan or a comma list of {choices}") from None
    return SaveList(ops=ops, alternate_matmuls=False)


def modelled_with_context_parallelism(policy: CheckpointPolicy, cp: int) -> bool:
    """Per-op selective checkpointing caches the SDPA call's outputs; under context parallelism
    that call is the whole ring, whose head merge after it is not cached: not modelled yet."""
    return cp == 1 or policy is not CheckpointPolicy.OPS


CONTEXT_PARALLEL_REFUSAL = ("--checkpoint-policy: per-op selective checkpointing under context parallelism is not "
                            "modelled (the ring's head merge after SDPA is recomputed, its outputs cached); use full "
                            "or attention with --cp, or --cp 1")


class CheckpointUnits(dict[int, int]):
    """Block -> checkpoint unit id, and the policy each unit runs under (``planner.memory.step``):
    ``policy`` unless ``overrides`` names another for the unit."""

    def __init__(self, units: dict[int, int], policy: CheckpointPolicy = CheckpointPolicy.FULL,
                 save: SaveList = TORCHTITAN_SAVE_LIST, overrides: dict[int, CheckpointPolicy] | None = None) -> None:
        super().__init__(units)
        self.policy = policy
        self.save = save
        self.overrides = overrides or {}

    def policy_of(self, unit: int) -> CheckpointPolicy:
        return self.overrides.get(unit, self.policy)


def op_units(kinds: list[OpKind], blocks: list[int | None], biases: list[bool],
             units: dict[int, int]) -> tuple[list[int | None], list[bool]]:
    """Per op of the graph (in order): its checkpoint unit (None: not checkpointed) and whether
    per-op selective checkpointing keeps its output (``cached``: not run again in the recompute)."""
    typed = units if isinstance(units, CheckpointUnits) else CheckpointUnits(units)
    unit: list[int | None] = [units.get(b) if b is not None else None for b in blocks]
    cached = [False] * len(kinds)
    saved = frozenset().union(*(_FAMILIES[op] for op in typed.save.ops))
    matmuls: dict[int, int] = {}
    for i, (u, kind) in enumerate(zip(unit, kinds, strict=True)):
        if u is None:
            continue
        policy = typed.policy_of(u)
        if policy is CheckpointPolicy.ATTENTION and kind not in _ATTENTION_CORES:
            unit[i] = None  # the attention core alone is the unit
        elif policy is CheckpointPolicy.OPS and kind in saved:
            if kind is OpKind.LINEAR:
                if biases[i]:
                    continue  # addmm: not aten.mm
                matmuls[u] = matmuls.get(u, 0) + 1
                if typed.save.alternate_matmuls and matmuls[u] % 2 == 0:
                    continue
            cached[i] = True
    return unit, cached
