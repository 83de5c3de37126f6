"""Knobs: the choices a plan fixes (micro-batch, accumulation, precision, checkpointing)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, computed_field, field_validator, model_validator

from planner.plan.checkpointing import TORCHTITAN_SAVE_LIST, CheckpointPolicy, SaveList
from planner.plan.parallel_dims import ParallelDims
from planner.plan.pipeline_schedules import PipelineSchedule
from planner.plan.schedule import Schedule, accumulation
from planner.precision import PrecisionPolicy


class GradSync(StrEnum):
    """When FSDP2 (ZeRO-2/3) reduce-scatters gradients during gradient accumulation."""

    EVERY = "every"  # after every micro-batch; the sharded gradients accumulate (FSDP2's default)
    LAST = "last"  # set_requires_gradient_sync(False) on all but the last micro-batch: every
    # parameter's unsharded gradient (in the reduce dtype) is held until the last one reduces it


class Knobs(BaseModel):
    """One training configuration for a given model and workload.

    ``checkpoint_blocks`` are checkpointed one block per unit; ``checkpoint_segments`` are
    (first, last) runs of consecutive blocks checkpointed as one unit (Chen et al. 2016): only
    the segment's input is kept and the whole segment is rebuilt before its backward.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: PositiveInt = Field(description="sequences per forward/backward on one GPU")
    grad_accum_steps: PositiveInt = Field(default=1, description="micro-batches per optimizer step")
    precision: PrecisionPolicy = PrecisionPolicy.BF16_MIXED
    checkpoint_blocks: tuple[int, ...] = Field(default=(), description="blocks checkpointed one by one")
    checkpoint_segments: tuple[tuple[int, int], ...] = Field(default=(), description="(first, last) segments")
    checkpoint_policy: CheckpointPolicy = Field(
        default=CheckpointPolicy.FULL, description="how checkpoint_blocks are checkpointed: the whole block, its "
        "attention core only, or per op with save_list (planner.plan.checkpointing)")
    save_list: SaveList = Field(default=TORCHTITAN_SAVE_LIST, description="what the ops policy keeps")
    block_policies: tuple[tuple[int, CheckpointPolicy], ...] = Field(
        default=(), description="blocks of checkpoint_blocks checkpointed with another policy than checkpoint_policy")
    parallel: ParallelDims = Field(default_factory=ParallelDims, description="degrees of the parallel dimensions")
    fsdp_grad_sync: GradSync = Field(
        default=GradSync.EVERY, description="ZeRO-2/3: reduce-scatter after every micro-batch or only the last"
    )
    pp_schedule: PipelineSchedule = Field(
        default=PipelineSchedule.ONE_F_ONE_B, description="pipeline parallelism (parallel.pp > 1): the schedule "
        "torch.distributed.pipelining runs, over grad_accum_steps micro-batches (planner.plan.pipeline_plan)")
    pp_virtual: PositiveInt = Field(
        default=1, description="pipeline stages per rank (looped schedules: interleaved-1f1b, looped-bfs)")
    pp_layers: tuple[PositiveInt, ...] = Field(
        default=(), description="blocks per pipeline stage, first stage first; () splits them evenly")

    @model_validator(mode="before")
    @classmethod
    def _data_parallel_shorthand(cls, data: Any) -> Any:
        """``data_parallel=N, zero_stage=S`` (and plan files written before ``parallel``) name a
        data-parallel layout: N ranks at ZeRO stage S."""
        if not isinstance(data, dict) or not ({"data_parallel", "zero_stage"} & data.keys()):
            return data
        data = dict(data)
        gpus, stage = data.pop("data_parallel", 1), data.pop("zero_stage", 0)
        if not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"knobs.data_parallel: {gpus!r} must be a positive integer")
        if "parallel" not in data:
            data["parallel"] = ParallelDims.data_parallel_of(gpus, stage)
            return data
        layout = ParallelDims.model_validate(data["parallel"])  # a plan file carries both (summary fields)
        if (layout.data_parallel, layout.zero_stage) != (gpus, stage):
            raise ValueError(f"knobs: data_parallel {gpus} / zero_stage {stage} disagree with parallel "
                             f"{data['parallel']}; give one of them")
        return data

    @field_validator("checkpoint_blocks", mode="before")
    @classmethod
    def _sorted_unique(cls, value: Any) -> Any:
        if isinstance(value, (set, frozenset, list, tuple)):
            return tuple(sorted(set(value)))
        return value

    @model_validator(mode="after")
    def _segments_well_formed(self) -> Knobs:
        covered: set[int] = set()
        for first, last in self.checkpoint_segments:
            if first > last or first < 0:
                raise ValueError(f"checkpoint segment ({first}, {last}) must satisfy 0 <= first <= last")
            span = set(range(first, last + 1))
            if span & covered or span & set(self.checkpoint_blocks):
                raise ValueError(f"checkpoint segment ({first}, {last}) overlaps another checkpoint unit")
            covered |= span
        if any(b < 0 for b in self.checkpoint_blocks):
            raise ValueError("checkpoint_blocks must be non-negative block indices")
        others = {block for block, _ in self.block_policies}
        if not others <= set(self.checkpoint_blocks) or len(others) != len(self.block_policies):
            raise ValueError("block_policies: name each block once, and only blocks of checkpoint_blocks")
        if self.checkpoint_segments and self.checkpoint_policy is not CheckpointPolicy.FULL:
            raise ValueError(f"checkpoint_segments: segments checkpoint whole blocks; the {self.checkpoint_policy.value} "
                             "policy applies to blocks one by one (checkpoint_blocks)")
        stages = self.parallel.pp * self.pp_virtual
        if self.pp_layers and len(self.pp_layers) != stages:
            raise ValueError(f"pp_layers: {len(self.pp_layers)} stages given for {stages} (parallel.pp {self.parallel.pp} "
                             f"x pp_virtual {self.pp_virtual}); give one block count per stage, or leave it out for an "
                             "even split")
        if self.fsdp_grad_sync is GradSync.LAST and not self.parallel.shards_parameters:
            raise ValueError("fsdp_grad_sync 'last' applies to ZeRO-2/3 (FSDP2); DDP and ZeRO-1 already reduce "
                             "gradients once per step")
        return self

    @property
    def policy_overrides(self) -> dict[int, CheckpointPolicy]:
        """Block -> its policy, where it is not ``checkpoint_policy``."""
        return dict(self.block_policies)

    @property
    def checkpointed(self) -> frozenset[int]:
        """Every checkpointed block, whatever its unit."""
        blocks = set(self.checkpoint_blocks)
        for first, last in self.checkpoint_segments:
            blocks.update(range(first, last + 1))
        return frozenset(blocks)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def data_parallel(self) -> int:
        """Ranks that each run their own micro-batches."""
        return self.parallel.data_parallel

    @computed_field  # type: ignore[prop-decorator]
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the data-parallel layout (0 on one GPU and under DDP)."""
        return self.parallel.zero_stage

    @property
    def schedule(self) -> Schedule:
        """The step's (micro-batch, phase) events: plain accumulation. Which backwards reduce
        gradients: DDP and ZeRO-1 only the last micro-batch's (``no_sync`` on the others), FSDP2
        every one unless ``fsdp_grad_sync`` is last."""
        ddp = self.parallel.data_parallel > 1 and not self.parallel.shards_parameters
        return accumulation(self.grad_accum_steps, sync_last=ddp or self.fsdp_grad_sync is GradSync.LAST)

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.data_parallel


def parse_checkpoint_spec(text: str, n_layers: int) -> tuple[int, ...]:
    """``none`` | ``all`` | ``0,2,5-9`` -> sorted block indices; errors name ``--checkpoint``."""
    from planner.errors import ConfigError

    value = text.strip().lower()
    if value in ("", "none"):
        return ()
    if value == "all":
        return tuple(range(n_layers))
    blocks: set[int] = set()
    for part in value.split(","):
        bounds = part.strip().split("-")
        try:
            numbers = [int(b) for b in bounds]
        except ValueError:
            raise ConfigError(
                f"--checkpoint: cannot read {part.strip()!r}; use none, all, or block indices like 0,2,5-9"
            ) from None
        if len(numbers) == 1:
            numbers = numbers * 2
        if len(numbers) != 2 or numbers[0] > numbers[1]:
            raise ConfigError(f"--checkpoint: {part.strip()!r} is not an index or a range first-last")
        blocks.update(range(numbers[0], numbers[1] + 1))
    outside = sorted(b for b in blocks if b >= n_layers)
    if outside:
        raise ConfigError(f"--checkpoint: block {outside[0]} does not exist; the model has blocks 0..{n_layers - 1}")
    return tuple(sorted(blocks))
